"""Starting, tracking and stopping the devcluster's server processes by PID.

Every process the devcluster starts gets a pidfile holding its PID and its
kernel start time, so `down` (even from another shell, after a crash) stops
exactly the processes it started and never a stranger that reused a PID.
Processes are never found or killed by name.
"""

import contextlib
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence

from cairn.devcluster import errors

# Children started by this process, kept so they can be reaped (and so that
# Popen does not warn about a running child it is collected with).
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Tracked:
    """A process we started: its PID and the start time that makes it unique."""

    name: str
    pid: int
    start_ticks: int


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if gone."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may contain spaces; fields after it are fixed.
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def is_alive(tracked: Tracked) -> bool:
    return _start_ticks(tracked.pid) == tracked.start_ticks


def read_pidfile(path: pathlib.Path) -> Tracked | None:
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return Tracked(name=data["name"], pid=data["pid"], start_ticks=data["start_ticks"])


def spawn(
    *,
    name: str,
    argv: Sequence[str],
    log_path: pathlib.Path,
    pidfile: pathlib.Path,
    env: Mapping[str, str] | None = None,
    cwd: pathlib.Path | None = None,
) -> Tracked:
    """Start `argv` in its own session with output to `log_path`; record it."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    pidfile.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        try:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
            )
        except FileNotFoundError as exc:
            raise errors.DevclusterError(f"cannot start {name}: {exc}") from exc
    _CHILDREN[proc.pid] = proc
    ticks = _start_ticks(proc.pid)
    tracked = Tracked(name=name, pid=proc.pid, start_ticks=ticks if ticks is not None else -1)
    pidfile.write_text(json.dumps(dataclasses.asdict(tracked)))
    return tracked


def stop(tracked: Tracked, *, grace_seconds: float) -> None:
    """SIGTERM the process group, wait up to `grace_seconds`, then SIGKILL it."""
    if not is_alive(tracked):
        _reap(tracked.pid)  # collect it if it is our own child that already died
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(tracked.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline:
        _reap(tracked.pid)
        if not is_alive(tracked):
            _reap(tracked.pid)  # it may have exited (a zombie) after the first look
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(tracked.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while is_alive(tracked) and time.monotonic() < deadline:
        _reap(tracked.pid)
        time.sleep(0.05)
    _reap(tracked.pid)


def stop_pidfile(pidfile: pathlib.Path, *, grace_seconds: float) -> None:
    tracked = read_pidfile(pidfile)
    if tracked is not None:
        stop(tracked, grace_seconds=grace_seconds)
    pidfile.unlink(missing_ok=True)


def _reap(pid: int) -> None:
    """Collect our own child's exit status so it does not linger as a zombie."""
    child = _CHILDREN.get(pid)
    if child is not None and child.poll() is not None:
        del _CHILDREN[pid]
