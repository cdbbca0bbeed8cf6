"""Processes are tracked and stopped by PID, with a grace period.

Covers: a spawned process is recorded with its start time and seen alive;
stop delivers SIGTERM and waits; a process that ignores SIGTERM is killed
after the grace period; a pidfile whose PID now belongs to another process
(same PID, other start time) is never acted on.
"""

import dataclasses
import pathlib
import sys
import time

from cairn.devcluster import processes

IGNORES_TERM = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"


def _spawn(tmp_path: pathlib.Path, code: str) -> processes.Tracked:
    return processes.spawn(
        name="t",
        argv=[sys.executable, "-c", code],
        log_path=tmp_path / "t.log",
        pidfile=tmp_path / "t.pid",
    )


def test_stop_terminates_gracefully(tmp_path: pathlib.Path) -> None:
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (print('got TERM', flush=True), sys.exit(0)))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    tracked = _spawn(tmp_path, code)
    assert processes.read_pidfile(tmp_path / "t.pid") == tracked
    deadline = time.monotonic() + 20
    while "ready" not in (tmp_path / "t.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes.is_alive(tracked)
    processes.stop(tracked, grace_seconds=10)
    assert not processes.is_alive(tracked)
    assert "got TERM" in (tmp_path / "t.log").read_text()


def test_sigkill_after_grace(tmp_path: pathlib.Path) -> None:
    tracked = _spawn(tmp_path, IGNORES_TERM)
    time.sleep(0.5)
    started = time.monotonic()
    processes.stop(tracked, grace_seconds=1.0)
    assert not processes.is_alive(tracked)
    assert time.monotonic() - started >= 1.0


def test_reused_pid_is_not_ours(tmp_path: pathlib.Path) -> None:
    tracked = _spawn(tmp_path, "import time; time.sleep(60)")
    stranger = dataclasses.replace(tracked, start_ticks=tracked.start_ticks + 1)
    assert not processes.is_alive(stranger)
    processes.stop(stranger, grace_seconds=1.0)
    assert processes.is_alive(tracked)
    processes.stop(tracked, grace_seconds=5.0)
    assert not processes.is_alive(tracked)
