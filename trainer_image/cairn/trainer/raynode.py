"""The Ray node launcher: ``python -m cairn.trainer.raynode -- <driver command>``.

The operator runs it in every pod of a ``runtime: ray`` job (docs/ray.md).
Decisions live in ``cairn.trainer.raynode_plan`` (pure); this module starts
and stops processes, by PID only (never ``ray stop``, which kills by name).

Head (node rank 0):
1. ``ray start --head --block`` as a child in its own session, so the
   SIGTERM the pod gets reaches the driver first and Ray stays up for the
   final checkpoint; the child dies with the launcher (``PR_SET_PDEATHSIG``)
   and Ray's own processes die with it (Ray's kernel fate sharing).
2. Waits (bounded, progress printed every few seconds) until ``CAIRN_NNODES``
   nodes are alive in the GCS.
3. Runs the driver with ``RAY_ADDRESS``; SIGTERM is forwarded to it once.
4. Announces the driver's exit code in Ray's internal KV, waits (bounded)
   for every worker whose Ray node is alive to acknowledge it
   (`raynode_plan.unacked_alive`), stops Ray by PID and exits with the
   driver's code (128 + N when a signal N killed it).

Worker: waits (bounded) for the head's GCS port, ``ray start --address …
--block``, records its node's address in the KV (`raynode_plan.node_ip_key`),
then polls the KV: it exits 0 only after it read a success,
non-zero when the head announced a failure or vanished without a word. A
SIGTERM keeps its Ray node up while the driver says the job is stopping
(the driver's preempting flag in the KV: the final checkpoint needs every
rank); without that flag within ``raynode_plan.LONE_LOSS_SECONDS`` the pod is
going alone, and it stops its Ray node at once (the driver then waits for the
pod the operator puts in its place).

A wrong Ray version or a malformed pod contract exits 78 with a termination
message (``cairn.api.exitcodes``) before Ray starts.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import types
import typing

from cairn.api import exitcodes
from cairn.trainer import raynode_plan, termination

log = logging.getLogger("cairn.trainer.raynode")

PROGRESS_EVERY_SECONDS = 5.0
POLL_SECONDS = 1.0
GCS_CALL_TIMEOUT_SECONDS = 2
HEAD_LOST_SECONDS = 20.0
"""A worker that cannot reach the head's GCS this long (and saw no outcome) gives up."""
ACK_TIMEOUT_SECONDS = 15.0
STOP_TIMEOUT_SECONDS = 30.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the launcher dies (no orphaned Ray)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _spawn(argv: typing.Sequence[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    log.info("raynode: starting %s", " ".join(argv))
    return subprocess.Popen(
        list(argv),
        env=env,
        start_new_session=True,
        preexec_fn=_die_with_parent,  # noqa: PLW1509 (the launcher starts no threads)
    )


def stop(child: subprocess.Popen[bytes], what: str) -> int:
    """SIGTERM by PID, bounded wait, then SIGKILL; the child's return code."""
    if child.poll() is None:
        log.info("raynode: stopping %s (pid %d)", what, child.pid)
        child.send_signal(signal.SIGTERM)
        try:
            return child.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            log.warning("raynode: %s did not stop in %.0fs: SIGKILL", what, STOP_TIMEOUT_SECONDS)
            child.kill()
    return child.wait()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def installed_ray_version() -> str | None:
    try:
        return importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        return None


class _Gcs:
    """The few GCS calls the launcher makes (Ray loaded only after the version check)."""

    def __init__(self, address: str) -> None:
        from ray._raylet import GcsClient  # type: ignore[attr-defined]  # after the version check

        host, _, port = address.rpartition(":")
        self.client = GcsClient(address=f"{socket.gethostbyname(host)}:{port}")

    def alive_nodes(self) -> int:
        return len(self.alive_addresses())

    def alive_addresses(self) -> list[str]:
        """The address of every alive Ray node (one per node: a list, not a set)."""
        infos = self.client.get_all_node_info(timeout=GCS_CALL_TIMEOUT_SECONDS)
        return [info.node_manager_address for info in infos.values() if info.state == 0]  # ALIVE

    def get(self, key: bytes) -> bytes | None:
        value: bytes | None = self.client.internal_kv_get(
            key, raynode_plan.OUTCOME_NAMESPACE, timeout=GCS_CALL_TIMEOUT_SECONDS
        )
        return value

    def put(self, key: bytes, value: bytes) -> None:
        self.client.internal_kv_put(
            key, value, True, raynode_plan.OUTCOME_NAMESPACE, timeout=GCS_CALL_TIMEOUT_SECONDS
        )


def _ack_key(rank: int) -> bytes:
    return raynode_plan.OUTCOME_KEY + f"-ack-{rank}".encode()


class _Signals:
    """SIGTERM/SIGINT: remembered, and forwarded once to the driver if it runs."""

    def __init__(self) -> None:
        self.terminated_at: float | None = None
        """monotonic() of the first SIGTERM/SIGINT."""
        self.driver: subprocess.Popen[bytes] | None = None

    @property
    def terminated(self) -> bool:
        return self.terminated_at is not None

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, _frame: types.FrameType | None) -> None:
        if self.terminated:
            return
        self.terminated_at = time.monotonic()
        if self.driver is not None and self.driver.poll() is None:
            log.info("raynode: signal %d: forwarding SIGTERM to the driver", signum)
            self.driver.send_signal(signal.SIGTERM)


def _fail(code: int, reason: str) -> int:
    log.error("raynode: %s (exit %d)", reason, code)
    termination.write_reason(reason)
    return code


def _wait_nodes(cfg: raynode_plan.NodeConfig, ray: subprocess.Popen[bytes], sig: _Signals) -> str:
    """'' when every node joined, else why not."""
    started = time.monotonic()
    last_print = 0.0
    gcs: _Gcs | None = None
    alive = 0
    while True:
        waited = time.monotonic() - started
        if ray.poll() is not None:
            return f"ray start --head exited with code {ray.returncode} before all nodes joined"
        if sig.terminated:
            return "stopped (SIGTERM) while waiting for the Ray nodes"
        try:
            gcs = gcs or _Gcs(f"{cfg.node_ip or '127.0.0.1'}:{cfg.port}")
            alive = gcs.alive_nodes()
        except Exception as exc:  # the GCS is still starting
            log.debug("raynode: GCS not ready: %s", exc)
        if alive >= cfg.nodes:
            print(raynode_plan.joined_message(alive, cfg.nodes, waited), flush=True)
            return ""
        if waited - last_print >= PROGRESS_EVERY_SECONDS:
            print(raynode_plan.joined_message(alive, cfg.nodes, waited), flush=True)
            last_print = waited
        if waited >= cfg.join_timeout_seconds:
            return (
                f"only {alive}/{cfg.nodes} Ray nodes joined within {cfg.join_timeout_seconds:.0f}s"
            )
        time.sleep(POLL_SECONDS)


def _announce(cfg: raynode_plan.NodeConfig, code: int) -> None:
    """Publish the driver's code, then wait (bounded) for every worker's ack."""
    try:
        gcs = _Gcs(f"{cfg.node_ip or '127.0.0.1'}:{cfg.port}")
        gcs.put(raynode_plan.OUTCOME_KEY, str(code).encode())
    except Exception as exc:  # the workers then exit non-zero: visible
        log.error("raynode: could not announce the driver's exit code %d: %s", code, exc)
        return
    deadline = time.monotonic() + ACK_TIMEOUT_SECONDS
    missing = set(range(1, cfg.nodes))
    addresses: dict[int, str | None] = {}
    while missing and time.monotonic() < deadline:
        for rank in sorted(missing):
            try:
                if gcs.get(_ack_key(rank)) is not None:
                    missing.discard(rank)
                elif addresses.get(rank) is None:
                    address = gcs.get(raynode_plan.node_ip_key(rank))
                    addresses[rank] = None if address is None else address.decode(errors="replace")
            except Exception as exc:
                log.debug("raynode: ack of rank %d unreadable: %s", rank, exc)
        try:  # a worker whose Ray node is gone never acks: do not wait for it
            waiting = raynode_plan.unacked_alive(missing, addresses, gcs.alive_addresses())
        except Exception as exc:
            log.debug("raynode: Ray nodes unreadable: %s", exc)
            waiting = missing
        if waiting != missing:
            log.info(
                "raynode: no ack awaited from worker ranks %s: their Ray nodes are gone",
                sorted(missing - waiting),
            )
            missing = waiting
        if missing:
            time.sleep(POLL_SECONDS / 4)
    if missing:
        log.warning("raynode: no ack from worker ranks %s", sorted(missing))


def run_head(cfg: raynode_plan.NodeConfig, sig: _Signals) -> int:
    env = raynode_plan.child_env(cfg, os.environ)
    ray = _spawn(raynode_plan.start_argv(cfg, sys.executable), env)
    try:
        why = _wait_nodes(cfg, ray, sig)
        if why:
            code = exitcodes.PREEMPTED if sig.terminated else raynode_plan.NOT_JOINED_EXIT
            return _fail(code, why)
        sig.driver = _spawn(cfg.driver, env)
        if sig.terminated:  # a SIGTERM between the wait and the spawn
            sig.driver.send_signal(signal.SIGTERM)
        code = _exit_code(sig.driver.wait())
        log.info("raynode: the driver exited with code %d", code)
        _announce(cfg, code)
        return code
    finally:
        if sig.driver is not None and sig.driver.poll() is None:
            stop(sig.driver, "the driver")
        stop(ray, "ray (head)")


def _wait_for_head(cfg: raynode_plan.NodeConfig, sig: _Signals) -> str:
    """'' once the head's GCS port accepts connections, else why not."""
    started = time.monotonic()
    last_print = -PROGRESS_EVERY_SECONDS
    while True:
        waited = time.monotonic() - started
        try:
            with socket.create_connection((cfg.head_host, cfg.port), timeout=2):
                return ""
        except OSError as exc:
            if waited - last_print >= PROGRESS_EVERY_SECONDS:
                print(f"raynode: waiting for the head {cfg.address}: {exc}", flush=True)
                last_print = waited
        if sig.terminated:
            return "stopped (SIGTERM) while waiting for the Ray head"
        if waited >= cfg.join_timeout_seconds:
            return f"the Ray head {cfg.address} was not reachable within {waited:.0f}s"
        time.sleep(POLL_SECONDS)


def _watch_outcome(
    cfg: raynode_plan.NodeConfig, ray: subprocess.Popen[bytes], sig: _Signals
) -> int | None:
    """Poll the head's KV until it announces the driver's code (acked), or the
    head is unreachable for HEAD_LOST_SECONDS, or the local Ray node exits, or
    a SIGTERM turns out to be this pod's loss alone (`raynode_plan.lone_loss`:
    the driver did not say the job is stopping; then Ray is stopped at once, so
    the driver sees the node gone and waits for the replacement pod)."""
    gcs: _Gcs | None = None
    last_ok = time.monotonic()
    preempting = False
    recorded = cfg.node_ip is None
    while ray.poll() is None:
        outcome = None
        try:
            gcs = gcs or _Gcs(cfg.address)
            if not recorded:  # for the head's ack wait (`raynode_plan.unacked_alive`)
                assert cfg.node_ip is not None
                gcs.put(raynode_plan.node_ip_key(cfg.rank), cfg.node_ip.encode())
                recorded = True
            outcome = raynode_plan.parse_outcome(gcs.get(raynode_plan.OUTCOME_KEY))
            if sig.terminated and not preempting:
                preempting = gcs.get(raynode_plan.PREEMPTING_KEY) is not None
            last_ok = time.monotonic()
            if outcome is not None:
                gcs.put(_ack_key(cfg.rank), b"1")
                return outcome
        except Exception as exc:  # counted as the head being away
            log.debug("raynode: head unreachable: %s", exc)
            if time.monotonic() - last_ok >= HEAD_LOST_SECONDS:
                return None
        since = None if sig.terminated_at is None else time.monotonic() - sig.terminated_at
        if raynode_plan.lone_loss(terminated_for=since, preempting=preempting, announced=outcome):
            print(
                "raynode: SIGTERM, and the driver is not stopping the job: this pod alone "
                "is going; stopping its Ray node now",
                flush=True,
            )
            return None
        time.sleep(POLL_SECONDS / 4 if sig.terminated and not preempting else POLL_SECONDS)
    log.warning("raynode: ray start exited with code %s", ray.returncode)
    return None


def run_worker(cfg: raynode_plan.NodeConfig, sig: _Signals) -> int:
    why = _wait_for_head(cfg, sig)
    if why:
        return _fail(exitcodes.PREEMPTED if sig.terminated else raynode_plan.HEAD_LOST_EXIT, why)
    env = raynode_plan.child_env(cfg, os.environ)
    ray = _spawn(raynode_plan.start_argv(cfg, sys.executable), env)
    try:
        outcome = _watch_outcome(cfg, ray, sig)
        ray_exit = ray.poll()
    finally:
        stop(ray, "ray (worker)")
    code, reason = raynode_plan.worker_exit(outcome, terminated=sig.terminated, ray_exit=ray_exit)
    if code != exitcodes.SUCCESS:
        return _fail(code, reason)
    log.info("raynode: %s", reason)
    return code


def _use_auth(cfg: raynode_plan.NodeConfig) -> str:
    """Ray's auth settings in the launcher's own env (its GCS calls; its
    children's env derives from it); '' or why the job's token is unusable."""
    if cfg.token_file is not None:
        try:
            why = raynode_plan.token_error(pathlib.Path(cfg.token_file).read_text())
        except OSError as exc:
            why = f"the Ray token file {cfg.token_file} is unreadable: {exc.strerror}"
        except UnicodeDecodeError:  # never echo the bytes: they may be a token
            why = f"the Ray token file {cfg.token_file} is not UTF-8 text"
        if why:
            return why
    env = raynode_plan.auth_env(cfg, os.environ)
    for name in set(os.environ) - set(env):
        del os.environ[name]
    os.environ.update(env)
    return ""


def main(argv: typing.Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        cfg = raynode_plan.config(os.environ, sys.argv[1:] if argv is None else argv)
    except raynode_plan.LauncherError as exc:
        return termination.config_error(exc)
    wrong = raynode_plan.version_error(wanted=cfg.version, installed=installed_ray_version())
    if wrong is not None:
        return termination.config_error(raynode_plan.LauncherError(wrong))
    why = _use_auth(cfg)
    if why:
        return termination.config_error(raynode_plan.LauncherError(why))
    sig = _Signals()
    sig.install()
    role = "head" if cfg.head else f"worker (rank {cfg.rank})"
    print(f"raynode: {role} of {cfg.nodes} nodes, head {cfg.address}", flush=True)
    return run_head(cfg, sig) if cfg.head else run_worker(cfg, sig)


if __name__ == "__main__":
    sys.exit(main())
