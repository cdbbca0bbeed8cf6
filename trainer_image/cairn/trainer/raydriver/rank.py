"""The rank actor: one process per rank, running the user's function.

The driver wraps `RankActor` with `ray.remote` (one CPU or GPU bundle each).
`run` executes in the actor process's main thread (a plain, non-threaded
actor), so the user's `signal.signal(SIGTERM, ...)` works as under torchrun.
Preemption reaches a rank on any node through the monitor: a watcher thread
polls it and delivers SIGTERM to its own process, which the trainer's handler
turns into a final checkpoint.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import socket
import threading
import time
import typing

import ray

from cairn.trainer import storewait

log = logging.getLogger(__name__)

PREEMPTION_POLL_SECONDS = 0.2


def load_target(target: str) -> typing.Callable[[list[str]], typing.Any]:
    """`module:function` -> the function (ValueError when malformed or missing)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"target {target!r}: expected MODULE:FUNCTION")
    module = importlib.import_module(module_name)
    func = getattr(module, attr, None)
    if not callable(func):
        raise ValueError(f"target {target!r}: {attr} is not a function of {module_name}")
    return typing.cast(typing.Callable[[list[str]], typing.Any], func)


def exit_code(result: object) -> int:
    """What a training function's return value means as an exit code (None -> 0)."""
    if result is None:
        return 0
    if isinstance(result, bool):
        return int(not result)
    if isinstance(result, int):
        return result
    return 0


class RankActor:
    """One rank: reports where it runs, then runs the training function."""

    def __init__(self, *, rank: int, group: int) -> None:
        self._rank = rank
        self._group = group
        self._stop = threading.Event()

    def prepare(self, modules: list[str]) -> dict[str, typing.Any]:
        """A standby's warm-up (`cairn.trainer.raydriver.standby`): import what
        every rank imports first, so that `run` does not; its pid and the seconds taken."""
        started = time.monotonic()
        for name in modules:
            importlib.import_module(name)
        return {"pid": os.getpid(), "seconds": time.monotonic() - started}

    def where(self) -> dict[str, typing.Any]:
        """This actor's node IP, pid, GPUs, and a free port (rank 0's becomes MASTER_PORT)."""
        ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]  # Ray untyped
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return {
            "ip": ip,
            "port": port,
            "pid": os.getpid(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
        }

    def run(self, target: str, argv: list[str], env: dict[str, str], monitor: typing.Any) -> int:
        """Set the rank's env, start the preemption watcher, call the function."""
        os.environ.update(env)
        for name in [k for k, v in env.items() if v == ""]:
            os.environ.pop(name, None)  # "" means unset (e.g. CAIRN_REPORT_STATUS off rank 0)
        func = load_target(target)
        # The group's ranks start at once: wait for rank 0's store quickly
        # rather than through torch's ~1 s connect backoff (cairn.trainer.storewait).
        storewait.wait_for_master_store(os.environ)
        watcher = threading.Thread(
            target=self._watch_preemption, args=(monitor,), name="cairn-preemption", daemon=True
        )
        watcher.start()
        try:
            return exit_code(func(list(argv)))
        except SystemExit as exc:
            # sys.exit("message") is a failure (1), as for a process.
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        finally:
            self._stop.set()

    def _watch_preemption(self, monitor: typing.Any) -> None:
        while not self._stop.wait(PREEMPTION_POLL_SECONDS):
            try:
                requested = ray.get(monitor.preemption.remote(), timeout=30)
            except Exception as exc:  # the monitor gone: the driver is going down too
                log.warning("rank %d: preemption poll failed: %s", self._rank, exc)
                continue
            if requested is not None:
                log.info("rank %d: preemption requested by the driver: SIGTERM to self", self._rank)
                os.kill(os.getpid(), signal.SIGTERM)
                return
