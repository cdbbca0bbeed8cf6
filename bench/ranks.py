"""Shared by the benches: run a bench script's rank entry point in N processes."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import typing


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run_ranks(
    script: str,
    cfg: dict[str, typing.Any],
    *,
    work: pathlib.Path,
    ranks: int,
    extra_env: dict[str, str] | None = None,
    timeout: float = 1800,
) -> list[dict[str, typing.Any]]:
    """Start `script --rank-config <cfg>` once per rank (torch.distributed env
    vars set), wait for all, and return each rank's `result-<rank>.json`."""
    cfg_path = work / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, script, "--rank-config", str(cfg_path)],
            env={
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": str(ranks),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TMPDIR": str(work),
                "OMP_NUM_THREADS": "1",
                **(extra_env or {}),
            },
        )
        for r in range(ranks)
    ]
    for proc in procs:
        if proc.wait(timeout=timeout) != 0:
            raise SystemExit(f"a rank failed with exit code {proc.returncode}")
    return [json.loads((work / f"result-{r}.json").read_text()) for r in range(ranks)]
