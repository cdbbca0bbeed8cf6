"""A Ray head started the way a ray job's rank-0 pod starts it, and clients probing it (not tests).

For `tests/e2e/test_adversary.py`'s Ray token cases. One real head (no
mocks): ``python -m cairn.trainer.raynode -- <driver>`` with the env the
operator gives a ray job's rank-0 pod, the token in a 0444 file named by
``CAIRN_RAY_TOKEN_FILE`` (the Secret's mount), and a user env that tries to
turn auth off (``RAY_AUTH_MODE=disabled``, a ``RAY_AUTH_TOKEN`` of its own):
the launcher must still start Ray with the job's token, and its driver
(``ray.init()`` with ``RAY_ADDRESS``) runs a task before `running` yields it.

`probe` runs a client in a process of its own, as a pod outside the job
would connect: ``gcs``, a GCS client (the first RPC of ``ray.init()`` and of
a worker's ``ray start``), whose refusal says ``InvalidAuthToken`` (a refused
``ray.init()`` says only ``ConnectionError`` after 20 s of retries, so it is
not the refusal probe); ``init``, a ``ray.init()`` client running a task.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from cairn.api import podenv
from tests import procs
from tests.integration.ray import rayhead

START_TIMEOUT = 120.0
STOP_TIMEOUT = 60.0
PROBE_TIMEOUT = 90.0

DRIVER = """
import os, pathlib, time, ray
ray.init(log_to_driver=False)
@ray.remote(num_cpus=0)
def answer():
    return 42
pathlib.Path(os.environ["PROBE_READY"]).write_text(str(ray.get(answer.remote(), timeout=60)))
deadline = time.monotonic() + 600
while not pathlib.Path(os.environ["PROBE_STOP"]).exists() and time.monotonic() < deadline:
    time.sleep(0.2)
"""

PROBE = """
import json, sys
mode, address = sys.argv[1], sys.argv[2]
try:
    if mode == "gcs":
        from ray._raylet import GcsClient
        client = GcsClient(address=address, cluster_id=None)
        print(json.dumps({"ok": True, "nodes": len(client.get_all_node_info(timeout=10))}))
    else:
        import ray
        ray.init(address=address, log_to_driver=False)
        @ray.remote(num_cpus=0)
        def answer():
            return 42
        print(json.dumps({"ok": True, "answer": ray.get(answer.remote(), timeout=60)}))
except Exception as exc:
    print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))
"""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Head:
    address: str
    token: str
    token_file: pathlib.Path
    log: pathlib.Path


def _launcher_env(root: pathlib.Path, *, port: int, token_file: pathlib.Path) -> dict[str, str]:
    """A rank-0 pod's env as the operator writes it (envvars.ray_env), on loopback."""
    env = rayhead.env_for_ray()
    for name in [k for k in env if k.startswith(("CAIRN_", "RAY_AUTH"))]:
        del env[name]
    env.update(
        {
            podenv.NODE_RANK: "0",
            podenv.NNODES: "1",
            podenv.MASTER_ADDR_CAIRN: "127.0.0.1",
            podenv.RAY_PORT: str(port),
            podenv.POD_IP: "127.0.0.1",
            podenv.RAY_NUM_CPUS: "1",
            podenv.RAY_OBJECT_STORE_BYTES: str(80 * 1024 * 1024),
            podenv.RAY_TOKEN_FILE: str(token_file),
            "CAIRN_RAY_TEMP_DIR": f"/tmp/ct{os.getpid()}-{port}",
            "CAIRN_RAY_JOIN_TIMEOUT_SECONDS": "60",
            "CAIRN_TERMINATION_MESSAGE_PATH": str(root / "termination-log"),
            # What a user's spec.env might try; the launcher must override both.
            "RAY_AUTH_MODE": "disabled",
            "RAY_AUTH_TOKEN": "a-token-of-the-users-choice",
            "PROBE_READY": str(root / "ready"),
            "PROBE_STOP": str(root / "stop"),
        }
    )
    return env


def _stop(proc: subprocess.Popen[bytes], stop_file: pathlib.Path) -> None:
    """Let the driver finish (the launcher then stops Ray by PID); bounded, then SIGKILL."""
    tree = procs.descendants(proc.pid)
    stop_file.write_text("stop")
    try:
        proc.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(STOP_TIMEOUT)
    for pid in [proc.pid, *tree, *procs.descendants(proc.pid)]:
        if rayhead.alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    proc.wait(STOP_TIMEOUT)


@contextlib.contextmanager
def running(root: pathlib.Path) -> Iterator[Head]:
    """The launcher's head with a fresh token, once its driver ran a task; stopped after."""
    token = secrets.token_hex(32)
    token_file = root / "token"
    token_file.write_text(token)
    token_file.chmod(0o444)  # as the Secret volume's defaultMode
    port = rayhead.free_port()
    env = _launcher_env(root, port=port, token_file=token_file)
    log = root / "raynode.log"
    argv = [sys.executable, "-m", podenv.RAYNODE_MODULE, "--", sys.executable, "-c", DRIVER]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not (root / "ready").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"the launcher's driver never ran a task (exit {proc.poll()}):\n"
                    + log.read_text(errors="replace")[-3000:]
                )
            time.sleep(0.2)
        assert (root / "ready").read_text() == "42"
        yield Head(address=f"127.0.0.1:{port}", token=token, token_file=token_file, log=log)
    finally:
        _stop(proc, root / "stop")


def probe(head: Head, mode: str, auth: dict[str, str]) -> dict[str, object]:
    """Run a client in a process of its own (Ray reads its auth settings at start)."""
    env = rayhead.env_for_ray()
    for name in [k for k in env if k.startswith(("CAIRN_", "RAY_AUTH", "RAY_ADDRESS"))]:
        del env[name]
    env["HOME"] = str(head.log.parent)  # no ~/.ray/auth_token of the caller's
    env.update(auth)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode, head.address],
        env=env,
        capture_output=True,
        text=True,
        timeout=PROBE_TIMEOUT,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    assert lines, f"the probe printed nothing (exit {done.returncode}):\n{done.stderr[-2000:]}"
    result: dict[str, object] = json.loads(lines[-1])
    return result


def assert_refused(result: dict[str, object]) -> None:
    assert result["ok"] is False
    assert "InvalidAuthToken" in str(result["error"]), result
