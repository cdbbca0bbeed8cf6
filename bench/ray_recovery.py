"""In-place recovery time of the Ray driver: SIGKILL of a rank actor → next training step.

    python bench/ray_recovery.py --runs 5 [--steps 40] [--out result.json]

Starts a real Ray head on loopback (by PID; stopped by PID), runs the
reference trainer under `python -m cairn.trainer.raydriver` with 2 rank
actors, and once step 4 is committed SIGKILLs rank 1's actor process `runs`
times in a row (each time in the newest group, after its first new step).
Recovery time = from the kill to the first loss line the new group writes
(`--losses-file`, rank 0, written right after the step's all-reduce), split
into: kill → driver noticed (log "group N ended"), → new group started (log
"group N+1 started": fenced, old actors gone, new actors placed), → first
step (restore from the last committed step, gloo init, one step). Prints the
median and spread (min/max) of each.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import pathlib
import re
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tests.integration.ray import harness, rayhead

_LOG_TIME = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) cairn\.trainer\.raydriver (.*)$")


def _log_events(log: pathlib.Path) -> list[tuple[float, str]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        match = _LOG_TIME.search(line)  # Ray may print its own text first
        if match:
            stamp = datetime.datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
            out.append((stamp.timestamp(), match.group(2)))
    return out


def _first_after(events: list[tuple[float, str]], text: str, after: float) -> float | None:
    return next((t for t, msg in events if text in msg and t >= after - 0.01), None)


def _new_step(run: pathlib.Path, *, lines: int, groups: int) -> bool:
    """A loss line written after `lines`, by a group after the first `groups - 1`."""
    return harness.loss_lines(run) > lines and len(harness.group_pids(run)) >= groups


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="ray-recovery-"))
    head = rayhead.start(work / "head", num_cpus=4)
    samples: list[dict[str, float]] = []
    try:
        run = work / "run"
        driver = harness.launch_driver(
            run,
            head,
            harness.base_env(run),
            steps=args.steps,
            driver_args=[f"--max-inplace-restarts={args.runs}"],
            trainer_extra=["--step-delay=0.2"],
        )
        harness.wait_until("step 4 committed", lambda: harness.committed(run, 4), driver, run)
        for index in range(args.runs):
            victim = harness.group_pids(run)[index][1]
            lines = harness.loss_lines(run)
            killed_at = time.time()
            os.kill(victim, signal.SIGKILL)
            harness.wait_until(
                f"a step of group {index + 1}",
                functools.partial(_new_step, run, lines=lines, groups=index + 2),
                driver,
                run,
            )
            stepped_at = time.time()
            events = _log_events(run / "driver.log")
            noticed = _first_after(events, f"group {index} ended", killed_at) or killed_at
            started = _first_after(events, f"group {index + 1} started", killed_at) or noticed
            samples.append(
                {
                    "total": stepped_at - killed_at,
                    "detect": noticed - killed_at,
                    "restart": started - noticed,
                    "first_step": stepped_at - started,
                }
            )
            print(
                f"run {index + 1}: {json.dumps({k: round(v, 3) for k, v in samples[-1].items()})}"
            )
        harness.kill_tree(driver)
    finally:
        head.stop()
    result = {
        "runs": len(samples),
        "ranks": 2,
        "samples": samples,
        **{key: _summary([s[key] for s in samples]) for key in samples[0]},
    }
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
