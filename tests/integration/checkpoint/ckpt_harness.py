"""Launch and kill multi-process gloo jobs of `ckpt_worker` (test helper).

Each job is `world` Python processes on loopback with env:// rendezvous on
a free port; each gets TMPDIR and TORCHINDUCTOR_CACHE_DIR under the test's
tmp dir. Every wait is bounded; kills go to the PIDs started here only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import typing

import numpy as np
import torch

REPO = pathlib.Path(__file__).resolve().parents[3]
PYTHONPATH = os.pathsep.join(
    str(REPO / p) for p in ("api", "operator", "trainer_image", "devcluster")
)
"""What a child interpreter needs to import the project (the tests tree has no install)."""
WORKER = pathlib.Path(__file__).with_name("ckpt_worker.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclasses.dataclass(kw_only=True)
class Job:
    procs: list[subprocess.Popen[bytes]]
    out: pathlib.Path
    logs: list[pathlib.Path]

    def wait(self, timeout: float = 120.0) -> None:
        """Wait for every rank to exit 0; kill all and fail otherwise."""
        deadline = time.monotonic() + timeout
        for rank, proc in enumerate(self.procs):
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as exc:
                self.kill()
                raise AssertionError(
                    f"rank {rank} did not finish in {timeout}s\n{self.tail()}"
                ) from exc
            if code != 0:
                self.kill()
                raise AssertionError(f"rank {rank} exited {code}\n{self.tail()}")

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)

    def tail(self) -> str:
        return "\n".join(
            f"--- rank {r} ---\n" + log.read_text(errors="replace")[-3000:]
            for r, log in enumerate(self.logs)
        )

    def result(self, rank: int) -> dict[str, typing.Any]:
        data: dict[str, typing.Any] = json.loads((self.out / f"result-rank{rank}.json").read_text())
        return data

    def dump(self, tag: str | int, rank: int = 0) -> dict[str, typing.Any]:
        data: dict[str, typing.Any] = torch.load(
            self.out / f"dump-{tag}-rank{rank}.pt", weights_only=False
        )
        return data


def launch(
    cfg: dict[str, typing.Any],
    *,
    world: int,
    tmp: pathlib.Path,
    name: str,
    env: dict[str, str] | None = None,
    prefix: dict[int, list[str]] | None = None,
) -> Job:
    """Start `world` ranks; `prefix[rank]` is put before that rank's command
    (e.g. `setpriv` to drop capabilities on one rank)."""
    out = tmp / name
    out.mkdir(parents=True)
    (tmp / "tmpdir").mkdir(exist_ok=True)
    cfg = {**cfg, "out": str(out)}
    cfg_path = out / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    port = free_port()
    procs = []
    logs = []
    for rank in range(world):
        log = out / f"log-rank{rank}.txt"
        logs.append(log)
        penv = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TMPDIR": str(tmp / "tmpdir"),
            "TORCHINDUCTOR_CACHE_DIR": str(tmp / "tmpdir" / "inductor"),
            "PYTHONPATH": PYTHONPATH,
            "OMP_NUM_THREADS": "1",
            # A native abort (SIGABRT: "terminate called without an active exception",
            # docs/operator.md) prints every Python thread's stack into the rank's log.
            "PYTHONFAULTHANDLER": "1",
            **(env or {}),
        }
        with log.open("wb") as stream:
            procs.append(
                subprocess.Popen(
                    [*(prefix or {}).get(rank, []), sys.executable, str(WORKER), str(cfg_path)],
                    env=penv,
                    stdout=stream,
                    stderr=subprocess.STDOUT,
                )
            )
    return Job(procs=procs, out=out, logs=logs)


def wait_for_file(path: pathlib.Path, *, job: Job, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if any(p.poll() is not None for p in job.procs):
            job.kill()
            raise AssertionError(f"a rank exited before reaching {path.name}\n{job.tail()}")
        if time.monotonic() > deadline:
            job.kill()
            raise AssertionError(f"{path.name} did not appear in {timeout}s\n{job.tail()}")
        time.sleep(0.05)


def sigkill(job: Job, rank: int) -> None:
    os.kill(job.procs[rank].pid, signal.SIGKILL)
    job.procs[rank].wait(timeout=10)


def s3_cfg(
    server: typing.Any, bucket: str, *, prefix: str = "jobs/demo", **kw: typing.Any
) -> dict[str, typing.Any]:
    """The worker's `s3` options for `s3://bucket/prefix` on the test's S3 server."""
    return {
        "uri": f"s3://{bucket}/{prefix}",
        "endpoint_url": server.endpoint_url,
        "region": server.region,
        "access_key": server.access_key,
        "secret_key": server.secret_key,
        **kw,
    }


def bucket_keys(server: typing.Any, bucket: str) -> list[str]:
    """Every object key in the bucket, sorted."""
    client = server.client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))


STATE_PARTS = ("model", "optim", "sched", "rng_torch", "rng_numpy", "rng_python", "data", "train")
"""Every part of a `ckpt_worker` full-state dump that a resume must restore."""


def _same(got: typing.Any, want: typing.Any) -> bool:
    """Bit-identical nested state (tensors, arrays, dicts, sequences, scalars)."""
    if isinstance(want, torch.Tensor):
        return (
            isinstance(got, torch.Tensor)
            and got.dtype == want.dtype
            and got.shape == want.shape
            and torch.equal(got, want)
        )
    if isinstance(want, np.ndarray):
        return isinstance(got, np.ndarray) and np.array_equal(got, want)
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and got.keys() == want.keys()
            and all(_same(got[k], want[k]) for k in want)
        )
    if isinstance(want, (list, tuple)):
        return (
            isinstance(got, (list, tuple))
            and len(got) == len(want)
            and all(_same(g, w) for g, w in zip(got, want, strict=True))
        )
    return bool(got == want)


def state_differences(got: dict[str, typing.Any], want: dict[str, typing.Any]) -> list[str]:
    """The state parts (`STATE_PARTS`, model per tensor) in which two dumps differ."""
    found = [
        part for part in STATE_PARTS if part != "model" and not _same(got.get(part), want.get(part))
    ]
    model_got = got.get("model", {})
    found += [f"model.{k}" for k, v in want["model"].items() if not _same(model_got.get(k), v)]
    return found
