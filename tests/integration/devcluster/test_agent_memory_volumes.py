"""The node agent's memory-backed emptyDir: a real tmpfs, sized, and released.

Covers `volumes.materialize` and `volumes.release` on this host (root: the
agent mounts as the kubelet does): `emptyDir {medium: Memory, sizeLimit}` is a
tmpfs of exactly that size at the volume's directory, writing past the size
fails with ENOSPC (the limit is real, not a label), a retried setup finds it
mounted and does not stack a second mount, a plain emptyDir stays a directory,
and `release` unmounts every mount under the pod's directory.
"""

import errno
import pathlib
from typing import Any

import pytest

from cairn.devcluster.agent import volumes

SIZE_LIMIT = "1Mi"


def _mounts_under(root: pathlib.Path) -> list[tuple[str, str, str]]:
    prefix = f"{root.resolve()}/"
    with open("/proc/self/mounts", encoding="utf-8") as mounts:
        rows = [line.split() for line in mounts]
    return [(r[1], r[2], r[3]) for r in rows if r[1].startswith(prefix)]


def _pod() -> dict[str, Any]:
    return {
        "metadata": {"namespace": "team-a", "name": "p", "uid": "u"},
        "spec": {
            "volumes": [
                {"name": "mem", "emptyDir": {"medium": "Memory", "sizeLimit": SIZE_LIMIT}},
                {"name": "disk", "emptyDir": {}},
            ]
        },
    }


@pytest.fixture
def pod_dir(tmp_path: pathlib.Path) -> Any:
    root = tmp_path / "pod"
    yield root
    volumes.release(root)  # never leave a mount behind, whatever the test did


def test_memory_empty_dir_is_a_sized_tmpfs_released_with_the_pod(pod_dir: pathlib.Path) -> None:
    dirs = volumes.materialize(core=None, pod=_pod(), pod_dir=pod_dir, pod_ip="10.0.0.1")
    mem, disk = pathlib.Path(dirs["mem"]), pathlib.Path(dirs["disk"])
    (mounted,) = _mounts_under(pod_dir)
    point, fstype, options = mounted
    assert point == str(mem.resolve()) and fstype == "tmpfs", mounted
    assert "size=1024k" in options.split(","), options
    assert not disk.is_mount()
    assert oct(mem.stat().st_mode & 0o777) == oct(0o777)

    # The limit is real: the second MiB does not fit.
    with pytest.raises(OSError) as full:
        (mem / "big").write_bytes(b"\0" * (2 * 1024 * 1024))
    assert full.value.errno == errno.ENOSPC

    # A retried setup (the agent retries `materialize`) does not stack mounts.
    volumes.materialize(core=None, pod=_pod(), pod_dir=pod_dir, pod_ip="10.0.0.1")
    assert len(_mounts_under(pod_dir)) == 1

    volumes.release(pod_dir)
    assert _mounts_under(pod_dir) == []
    assert not mem.is_mount()
