"""Exactly-once training: killed anywhere and resumed, the run is bit-identical.

Covers: the reference FSDP2 trainer (2 ranks, gloo, CPU, uploads to the real
S3 server) killed with SIGKILL at six moments — during staging, the write,
the commit, the upload, rotation, and at a random moment — and resumed each
time (a new attempt id each time, as the operator gives) ends with per-step
losses and final exported weights identical bit for bit to an uninterrupted
run; and a resume of a 2-rank checkpoint on 1 rank reaches the final loss
within 1e-3 (same global batch and data order; only the
reduction order differs).
"""

import contextlib
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.procs import descendants

pytestmark = [pytest.mark.torch, pytest.mark.s3]

STEPS = 12
RUN_TIMEOUT = 240.0


def _env(tmp: pathlib.Path, s3: Any, bucket: str, attempt: int, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        TMPDIR=str(tmp),
        TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"),
        CAIRN_ATTEMPT=str(attempt),
        CAIRN_CHECKPOINT_INTERVAL_STEPS="2",
        CAIRN_KEEP_LAST="2",
        CAIRN_UPLOAD_URI=f"s3://{bucket}/run",
        AWS_ENDPOINT_URL_S3=s3.endpoint_url,
        AWS_ACCESS_KEY_ID=s3.access_key,
        AWS_SECRET_ACCESS_KEY=s3.secret_key,
        AWS_REGION=s3.region,
        CAIRN_CKPT_FAULT_DIR=str(tmp),
        CAIRN_CKPT_FAULT_SLEEP="60",
    )
    env.update(extra)
    return env


def _launch(
    run_dir: pathlib.Path, env: dict[str, str], *, nproc: int, port: int
) -> subprocess.Popen[bytes]:
    argv = [
        str(pathlib.Path(sys.executable).parent / "torchrun"),
        f"--nproc-per-node={nproc}",
        f"--master-port={port}",
        "-m",
        "cairn.trainer.reference",
        f"--steps={STEPS}",
        f"--checkpoint-dir={run_dir / 'ckpt'}",
        f"--losses-file={run_dir / 'losses.jsonl'}",
        f"--export={run_dir / 'model.safetensors'}",
        # The global batch stays 8 whatever the world size, so the data order is the same.
        f"--batch-per-rank={8 // nproc}",
    ]
    # One log per launch; log.txt always holds the latest one.
    latest = run_dir / "log.txt"
    if latest.exists():
        latest.rename(run_dir / f"log-{len(list(run_dir.glob('log-*.txt')))}.txt")
    with latest.open("wb") as log:
        return subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL torchrun and every worker. torch's elastic agent starts each worker
    in a session of its own (`start_new_session`), so killing torchrun's process
    group alone leaves the workers running on as zombie writers of the old attempt."""
    workers = descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in workers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(30)
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Running, not merely a zombie waiting for init to reap it."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait(proc: subprocess.Popen[bytes], run_dir: pathlib.Path) -> int:
    try:
        return proc.wait(RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        _kill(proc)
        raise AssertionError((run_dir / "log.txt").read_text()[-3000:]) from None


def _losses(run_dir: pathlib.Path) -> dict[int, float]:
    """The loss of each step in the surviving lineage (a resumed step overwrites)."""
    out: dict[int, float] = {}
    for line in (run_dir / "losses.jsonl").read_text().splitlines():
        entry = json.loads(line)
        out[entry["step"]] = entry["loss"]
    return out


def test_killed_six_times_equals_uninterrupted(tmp_path: pathlib.Path, s3_server: Any) -> None:
    straight = tmp_path / "straight"
    straight.mkdir()
    bucket = s3_server.new_bucket("straight")
    proc = _launch(straight, _env(straight, s3_server, bucket, 1), nproc=2, port=29631)
    assert _wait(proc, straight) == 0

    killed = tmp_path / "killed"
    killed.mkdir()
    bucket = s3_server.new_bucket("killed")
    faults = ["staging:0:4", "write:1:6", "commit:0:6", "upload:1:8", "rotate:0:10", "random"]
    rng = random.Random(20261122)
    attempt = 0
    for fault in faults:
        attempt += 1
        extra = {} if fault == "random" else {"CAIRN_CKPT_FAULT": fault}
        proc = _launch(
            killed, _env(killed, s3_server, bucket, attempt, **extra), nproc=2, port=29632
        )
        if fault == "random":
            time.sleep(rng.uniform(6.0, 12.0))
        else:
            phase, rank, step = fault.split(":")
            marker = killed / f"{phase}-{rank}-{step}"
            deadline = time.monotonic() + RUN_TIMEOUT
            while not marker.exists():
                assert proc.poll() is None, (killed / "log.txt").read_text()[-3000:]
                assert time.monotonic() < deadline, f"never reached {fault}"
                time.sleep(0.1)
            marker.unlink()
        _kill(proc)
    attempt += 1
    proc = _launch(killed, _env(killed, s3_server, bucket, attempt), nproc=2, port=29633)
    assert _wait(proc, killed) == 0

    assert _losses(killed) == _losses(straight)
    assert sorted(_losses(straight)) == list(range(1, STEPS + 1))
    assert (killed / "model.safetensors").read_bytes() == (
        straight / "model.safetensors"
    ).read_bytes()


def test_two_ranks_resume_on_one(tmp_path: pathlib.Path, s3_server: Any) -> None:
    straight = tmp_path / "straight"
    straight.mkdir()
    bucket = s3_server.new_bucket("twotoone-a")
    proc = _launch(straight, _env(straight, s3_server, bucket, 1), nproc=2, port=29641)
    assert _wait(proc, straight) == 0

    resharded = tmp_path / "resharded"
    resharded.mkdir()
    bucket = s3_server.new_bucket("twotoone-b")
    proc = _launch(
        resharded,
        _env(resharded, s3_server, bucket, 1, CAIRN_CKPT_FAULT="staging:0:8"),
        nproc=2,
        port=29642,
    )
    deadline = time.monotonic() + RUN_TIMEOUT
    while not (resharded / "staging-0-8").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    _kill(proc)
    proc = _launch(resharded, _env(resharded, s3_server, bucket, 2), nproc=1, port=29643)
    assert _wait(proc, resharded) == 0
    assert "resumed from step 6" in (resharded / "log.txt").read_text()
    final_straight = _losses(straight)[STEPS]
    final_resharded = _losses(resharded)[STEPS]
    assert abs(final_straight - final_resharded) < 1e-3
