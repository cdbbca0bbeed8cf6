"""A zombie rank actor of an old group can never commit.

A real rank actor of group 0 (the reference trainer, world size 1, real
gloo, a real Ray head) is held at the `write` pause point of step 2 while
the driver's recovery step happens: the monitor advances to group 1.
Released, the zombie reports its files to the monitor and is refused
(FencedError): no step-2 folder is committed, its temporary folder is left
for rotation. A coordinator of the new group works against the same monitor,
and the zombie's commit fence (checked right before the rename) refuses it
too. The scenario runs as its own Ray client process (`zombie_scenario`).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from tests.integration.ray import harness, rayhead

pytestmark = [pytest.mark.torch]

SCENARIO = pathlib.Path(__file__).with_name("zombie_scenario.py")
REPO = pathlib.Path(__file__).resolve().parents[3]


@pytest.mark.timeout(900)
def test_zombie_of_old_group_cannot_commit(
    tmp_path: pathlib.Path, ray_head: rayhead.RayHead
) -> None:
    log = tmp_path / "scenario.log"
    with log.open("wb") as out:
        proc = subprocess.run(
            [sys.executable, str(SCENARIO), ray_head.address, str(tmp_path)],
            env={**rayhead.env_for_ray(), "PYTHONPATH": str(REPO)},
            cwd=tmp_path,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=800,
            check=False,
        )
    assert proc.returncode == 0, log.read_text(errors="replace")[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert "error" not in result, result
    assert result["fresh_reads"] == {"ok": True}
    assert "replaced by group 1" in result["old_fence"]
    assert "fenced" in result["zombie"], result["zombie"]
    assert result["last_committed"] is None
    assert not harness.committed(tmp_path, 2)
    assert not (tmp_path / "ckpt" / "step-000000002").exists()
    assert (tmp_path / "ckpt" / ".step-000000002.tmp-local-a1").is_dir()
