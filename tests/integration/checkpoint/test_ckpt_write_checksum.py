"""The one-pass write on real ranks: manifest sizes and CRC32Cs equal a read-back.

Covers: a 2-rank FSDP2 job (gloo, 2 write threads per rank) saves twice on
a shared volume and on node-local volumes; in every committed step folder,
each manifest entry present there has exactly the size and CRC32C that
reading the file back gives (`layout.entry_for`, the post-hoc computation
the write phase no longer runs), and the manifest lists every data file the
ranks wrote (`__<rank>_<n>.distcp` and `.metadata`), nothing more.
"""

from __future__ import annotations

import pathlib

import ckpt_harness  # type: ignore[import-not-found]
import pytest

from cairn.checkpoint import layout

pytestmark = pytest.mark.torch

DATA_FILES = {".metadata", "__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp"}


@pytest.mark.parametrize("volume", ["shared", "node-local"])
def test_manifest_entries_equal_a_read_back(tmp_path: pathlib.Path, volume: str) -> None:
    directory = tmp_path / ("ckpt" if volume == "shared" else "ckpt-{rank}")
    job = ckpt_harness.launch(
        {"dir": str(directory), "steps": 4, "interval": 2, "keep_last": 3},
        world=2,
        tmp=tmp_path,
        name="job",
    )
    job.wait()
    roots = [pathlib.Path(str(directory).format(rank=rank)) for rank in range(2)]
    for root in roots if volume == "node-local" else roots[:1]:
        assert layout.committed_steps(root) == [2, 4]
        for step in (2, 4):
            folder = layout.step_dir(root, step)
            manifest = layout.read_manifest(folder)
            assert {e.path for e in manifest.files} == DATA_FILES
            present = [e for e in manifest.files if (folder / e.path).exists()]
            if volume == "shared":
                assert len(present) == len(DATA_FILES)
            for entry in present:
                assert entry == layout.entry_for(folder, entry.path, rank=entry.rank)
