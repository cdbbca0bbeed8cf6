"""Warm vs cold in-place restart on one machine, no cluster: torchrun vs cairn.trainer.launch.

    python bench/warm_restart_local.py [--restarts 5] [--device cpu|cuda] [--out result.json]

For each launcher, one ``--standalone`` group of 2 workers (``--nproc-per-node
2``, ``--max-restarts N``, gloo; with ``--device cuda`` each worker also
initialises CUDA and runs a matmul per step, both on GPU 0). Each group
imports torch, joins the process group and steps (an all-reduce every 50 ms);
rank 1 SIGKILLs itself after its first step, ``--restarts`` times. Recovery =
from that kill to rank 0's first step of the next group (wall clock, one
host); also printed: each worker's import time (torch + CUDA init), which
the warm launcher's fork server pays once. The devcluster figure (operator,
checkpoint restore, status) is bench/mttr.py's; this one isolates the
launcher, and runs where only torch is installed (the device machine).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCHERS = {
    "torchrun": ["-m", "torch.distributed.run"],
    "warm": ["-m", "cairn.trainer.launch"],
}


def worker(out: pathlib.Path, restarts: int, device: str) -> None:
    """One worker of a group: import, join, step; rank 1 of every group but the last dies."""
    started = time.time()
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.zeros(1, device=device)  # the CUDA context, part of a cold start
    imported = time.time() - started
    rank, restart = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo")
    x = torch.ones(256, 256, device=device)
    step = 0
    while True:
        (x @ x).sum().item()
        value = torch.ones(1)
        dist.all_reduce(value)
        if step == 0:
            with (out / "steps.jsonl").open("a") as log:
                entry = {"rank": rank, "restart": restart, "first_step": time.time()}
                log.write(json.dumps({**entry, "import_s": imported}) + "\n")
        step += 1
        if restart == restarts and step >= 3:
            dist.destroy_process_group()
            return
        if rank == 1 and restart < restarts:
            with (out / "kills.jsonl").open("a") as log:
                log.write(json.dumps({"restart": restart, "killed": time.time()}) + "\n")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.05)


def run(launcher: str, *, restarts: int, device: str) -> dict[str, object]:
    out = pathlib.Path(tempfile.mkdtemp(prefix=f"warm-{launcher}-"))
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "trainer_image"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, *LAUNCHERS[launcher], "--standalone", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", str(restarts), __file__, "--worker", "--out", str(out)]
    cmd += ["--restarts", str(restarts), "--device", device]
    began = time.time()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode:
        print(done.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{launcher}: exit {done.returncode}")
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    kills = [json.loads(line) for line in (out / "kills.jsonl").read_text().splitlines()]
    first = {s["restart"]: s["first_step"] for s in steps if s["rank"] == 0}
    recovery = [first[k["restart"] + 1] - k["killed"] for k in kills]
    imports = [s["import_s"] for s in steps if s["restart"] > 0]
    return {
        "recovery_s": recovery,
        "median_s": statistics.median(recovery),
        "restarted_worker_import_s": statistics.median(imports),
        "wall_s": time.time() - began,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/warm_restart_local.py")
    parser.add_argument("--restarts", type=int, default=5)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args(argv)
    if args.worker:
        worker(args.out, args.restarts, args.device)
        return 0
    result: dict[str, object] = {"device": args.device, "load_average": os.getloadavg()}
    for launcher in LAUNCHERS:
        result[launcher] = run(launcher, restarts=args.restarts, device=args.device)
        print(launcher, json.dumps(result[launcher]), flush=True)
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
