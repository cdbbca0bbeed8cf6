"""Run the reference trainer under the Ray driver or torchrun (test and bench helper).

Each run gets its own directory (checkpoints, losses, export, log, TMPDIR);
the driver runs as a child process in its own session, killed by PID only.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import typing

from tests import procs
from tests.integration.ray import rayhead

RUN_TIMEOUT = 420.0
_GROUP_RE = re.compile(r"group (\d+) started: \d+ ranks, pids \[([\d, ]+)\]")


def trainer_args(
    run_dir: pathlib.Path, *, steps: int, extra: typing.Sequence[str] = ()
) -> list[str]:
    return [
        f"--steps={steps}",
        f"--checkpoint-dir={run_dir / 'ckpt'}",
        f"--losses-file={run_dir / 'losses.jsonl'}",
        f"--export={run_dir / 'model.safetensors'}",
        "--batch-per-rank=4",
        *extra,
    ]


def base_env(run_dir: pathlib.Path, **extra: str) -> dict[str, str]:
    env = rayhead.env_for_ray()
    for name in [k for k in env if k.startswith("CAIRN_")]:
        del env[name]  # the caller's own settings never leak into a run
    env.update(
        TMPDIR=str(run_dir),
        TORCHINDUCTOR_CACHE_DIR=str(run_dir / "inductor"),
        CAIRN_ATTEMPT="1",
        CAIRN_CHECKPOINT_INTERVAL_STEPS="2",
        CAIRN_KEEP_LAST="2",
        CAIRN_TERMINATION_MESSAGE_PATH=str(run_dir / "termination-log"),
    )
    env.update(extra)
    return env


def launch_driver(
    run_dir: pathlib.Path,
    head: rayhead.RayHead,
    env: dict[str, str],
    *,
    steps: int,
    ranks: int = 2,
    driver_args: typing.Sequence[str] = (),
    trainer_extra: typing.Sequence[str] = (),
) -> subprocess.Popen[bytes]:
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "cairn.trainer.raydriver",
        f"--address={head.address}",
        "--nodes=1",
        f"--procs-per-node={ranks}",
        *driver_args,
        "cairn.trainer.reference:main",
        "--",
        *trainer_args(run_dir, steps=steps, extra=trainer_extra),
    ]
    with (run_dir / "driver.log").open("ab") as log:
        return subprocess.Popen(
            argv, env=env, cwd=run_dir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def launch_torchrun(
    run_dir: pathlib.Path, env: dict[str, str], *, steps: int, port: int
) -> subprocess.Popen[bytes]:
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        str(pathlib.Path(sys.executable).parent / "torchrun"),
        "--nproc-per-node=2",
        f"--master-port={port}",
        "-m",
        "cairn.trainer.reference",
        *trainer_args(run_dir, steps=steps),
    ]
    with (run_dir / "torchrun.log").open("ab") as log:
        return subprocess.Popen(
            argv, env=env, cwd=run_dir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def log_text(run_dir: pathlib.Path) -> str:
    return "".join(
        p.read_text(errors="replace")[-6000:]
        for p in (run_dir / "driver.log", run_dir / "torchrun.log")
        if p.exists()
    )


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process and every descendant (by PID, bounded)."""
    tree = procs.descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(30)


def wait(proc: subprocess.Popen[bytes], run_dir: pathlib.Path, timeout: float = RUN_TIMEOUT) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        raise AssertionError(f"run did not finish in {timeout}s\n{log_text(run_dir)}") from None


def wait_until(
    what: str,
    check: typing.Callable[[], bool],
    proc: subprocess.Popen[bytes],
    run_dir: pathlib.Path,
) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT
    while not check():
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode} before {what}\n{log_text(run_dir)}")
        if time.monotonic() > deadline:
            kill_tree(proc)
            raise AssertionError(f"never saw {what}\n{log_text(run_dir)}")
        time.sleep(0.05)


def group_pids(run_dir: pathlib.Path) -> dict[int, list[int]]:
    """Rank-actor pids of every group the driver started, from its log."""
    text = (run_dir / "driver.log").read_text(errors="replace")
    return {
        int(m.group(1)): [int(p) for p in m.group(2).split(",")] for m in _GROUP_RE.finditer(text)
    }


def committed(run_dir: pathlib.Path, step: int) -> bool:
    return (run_dir / "ckpt" / f"step-{step:09d}" / "manifest.json").exists()


def losses(run_dir: pathlib.Path) -> dict[int, float]:
    """The loss of each step in the surviving lineage (a re-run step overwrites)."""
    out: dict[int, float] = {}
    for line in (run_dir / "losses.jsonl").read_text().splitlines():
        entry = json.loads(line)
        out[entry["step"]] = entry["loss"]
    return out


def loss_lines(run_dir: pathlib.Path) -> int:
    path = run_dir / "losses.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0
