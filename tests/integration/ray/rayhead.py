"""A real Ray head on loopback for tests and benches, started and stopped by PID.

`ray start --head --block` runs as our child in a session of its own; its
temp dir, ports and logs are private to the caller. Stopping sends SIGTERM to
that PID (ray start --block then stops what it started), waits bounded, and
SIGKILLs every process of the head's tree still alive (found through /proc
before the stop): never `ray stop`, which kills by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

from tests.procs import descendants

START_TIMEOUT = 120.0
STOP_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def env_for_ray(base: dict[str, str] | None = None) -> dict[str, str]:
    """The env of any Ray process on loopback: without RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
    Ray replaces 127.0.0.1 by the host address and clients never reach the head."""
    env = dict(os.environ if base is None else base)
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def alive(pid: int) -> bool:
    """Running, not merely a zombie waiting to be reaped."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclasses.dataclass(kw_only=True)
class RayHead:
    proc: subprocess.Popen[bytes]
    address: str
    temp_dir: pathlib.Path
    log: pathlib.Path

    def stop(self) -> None:
        tree = descendants(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT)
        for pid in tree + descendants(self.proc.pid):
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def start(root: pathlib.Path, *, num_cpus: int = 4) -> RayHead:
    """Start a head (no dashboard, small object store) and wait until it answers."""
    root.mkdir(parents=True, exist_ok=True)
    # Ray's socket paths must stay short (AF_UNIX limit): a short private dir.
    temp_dir = (
        pathlib.Path(os.environ.get("CAIRN_RAY_TMP_BASE", "/tmp"))
        / f"cr{os.getpid()}-{free_port()}"
    )
    temp_dir.mkdir(parents=True)
    port = free_port()
    ray_bin = pathlib.Path(sys.executable).parent / "ray"
    log = root / "ray-head.log"
    argv = [
        str(ray_bin),
        "start",
        "--head",
        "--block",
        f"--port={port}",
        "--node-ip-address=127.0.0.1",
        f"--num-cpus={num_cpus}",
        "--num-gpus=0",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--object-store-memory={100 * 1024 * 1024}",
        f"--temp-dir={temp_dir}",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, env=env_for_ray(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    head = RayHead(proc=proc, address=f"127.0.0.1:{port}", temp_dir=temp_dir, log=log)
    deadline = time.monotonic() + START_TIMEOUT
    while "Ray runtime started" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            head.stop()
            raise RuntimeError(
                f"ray head did not start:\n{log.read_text(errors='replace')[-3000:]}"
            )
        time.sleep(0.2)
    return head
