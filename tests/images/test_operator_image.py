"""The built operator image, checked from outside with `buildah run`.

`.ci/run` builds the image with `scripts/build-images` and then runs these
tests (they are not in the default test paths: building needs root, buildah
and minutes the first time). The image under test is `$CAIRN_OPERATOR_IMAGE`
(default `localhost/cairn-operator:dev`) in scripts/build-images' storage; a
missing image fails the tests with the command that builds it.

Covers: the operator's entrypoint module answers `--help` with exit 0; the
image runs as the unprivileged user 65532, both as configured and in fact;
it contains neither torch nor the devcluster (no importable module, no
installed distribution); every installed distribution has the version that
requirements.lock pins.
"""

import collections.abc
import json
import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD_IMAGES = ROOT / "scripts" / "build-images"
IMAGE = os.environ.get("CAIRN_OPERATOR_IMAGE", "localhost/cairn-operator:dev")
TIMEOUT_S = 120


def _buildah(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BUILD_IMAGES), "--buildah", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


@pytest.fixture(scope="module")
def container() -> collections.abc.Iterator[str]:
    if _buildah("inspect", "--type", "image", IMAGE).returncode != 0:
        pytest.fail(f"no image {IMAGE}: build it with scripts/build-images")
    created = _buildah("from", "--pull=never", IMAGE)
    assert created.returncode == 0, created.stderr
    name = created.stdout.strip()
    yield name
    _buildah("rm", name)


def _run(container: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return _buildah("run", "--isolation", "chroot", container, "--", *argv)


def test_operator_help_exits_zero(container: str) -> None:
    result = _run(container, "python", "-m", "cairn.operator", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage:")
    assert "--namespace" in result.stdout


def test_runs_as_unprivileged_user(container: str) -> None:
    config = json.loads(_buildah("inspect", "--type", "image", IMAGE).stdout)
    assert config["OCIv1"]["config"]["User"] == "65532:65532"
    result = _run(container, "python", "-c", "import os; print(os.getuid(), os.getgid())")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["65532", "65532"]


def test_contains_no_torch_and_no_devcluster(container: str) -> None:
    probe = (
        "import importlib.metadata as md, importlib.util as u, json;"
        "print(json.dumps({"
        "'modules': [m for m in ('torch', 'cairn.devcluster', 'cairn.operator')"
        " if u.find_spec(m) is not None],"
        "'dists': sorted(d.metadata['Name'].lower() for d in md.distributions())}))"
    )
    result = _run(container, "python", "-c", probe)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert found["modules"] == ["cairn.operator"]
    assert "torch" not in found["dists"]
    assert not [d for d in found["dists"] if "devcluster" in d]
    assert "cairn-training" in found["dists"]


def test_installed_versions_are_the_locked_ones(container: str) -> None:
    pins = dict(
        (re.sub(r"[-_.]+", "-", name).lower(), version)
        for name, version in re.findall(
            r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "requirements.lock").read_text(), re.M
        )
    )
    probe = (
        "import importlib.metadata as md, json;"
        "print(json.dumps({d.metadata['Name']: d.version for d in md.distributions()}))"
    )
    result = _run(container, "python", "-c", probe)
    assert result.returncode == 0, result.stderr
    installed = {
        re.sub(r"[-_.]+", "-", name).lower(): version
        for name, version in json.loads(result.stdout).items()
    }
    installed.pop("cairn-training")
    assert installed
    assert {n: v for n, v in installed.items() if pins.get(n) != v} == {}
