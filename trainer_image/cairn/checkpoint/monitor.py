"""The `CheckpointMonitor`: the coordinator store of a Ray rank-actor group.

Under the Ray driver (`cairn.trainer.raydriver`) there is no torchrun
TCPStore: the driver starts one named actor of this class per attempt and
every rank's `CheckpointManager` talks to it through
`cairn.checkpoint.raycoordinator.RayCoordinator` (the same `Coordinator`
protocol as the c10d store). The class itself is plain Python, no Ray import:
the driver wraps it with `ray.remote`, unit tests use it directly.

Fencing by generation: every call names the caller's rank-actor group. The
driver raises the group (`advance`) BEFORE it starts a new group in place;
from then on every call of an older group is answered `{"fenced": reason}`
(the client raises `FencedError`), so a zombie rank of an old group can
neither report files, nor commit, nor wait for anything of the new group.
Keys are kept per group, so two groups never read each other's reports.

The monitor also carries the driver's preemption request (SIGTERM of the
head) to the ranks, which poll it and deliver SIGTERM to themselves, and
remembers the newest step a group committed (the `fromStep` of the next
in-place restart).
"""

from __future__ import annotations

import re
import time
import typing

ACTOR_NAME = "cairn-checkpoint-monitor"
"""The monitor's actor name in the driver's Ray namespace."""
MONITOR_ENV = "CAIRN_RAY_MONITOR"
"""Set by the driver in each rank actor: the monitor's actor name. The
manager's default coordinator is the monitor when it is set."""
NAMESPACE_ENV = "CAIRN_RAY_NAMESPACE"
"""The Ray namespace the monitor lives in (set by the driver)."""
GROUP_ENV = "CAIRN_RAY_GROUP"
"""The rank actor's group generation (set by the driver; 0 without Ray)."""

_COMMITTED_RE = re.compile(r"(?:^|/)step-(\d+)/committed$")

Reply = dict[str, typing.Any]
"""`{"value": ...}` / `{"values": [...]}` / `{"missing": True}` / `{"fenced": reason}`."""


class CheckpointMonitor:
    """Per-group key/value store with compare-and-set and group fencing."""

    def __init__(self, *, group: int = 0) -> None:
        self._group = group
        self._values: dict[str, dict[str, typing.Any]] = {}
        self._preempt_at: float | None = None
        self._committed: int | None = None
        self._proposed: set[str] = set()
        """Commit keys whose manifest was proposed once (node-local: not committed yet)."""

    # -- fencing -------------------------------------------------------------------

    def group(self) -> int:
        return self._group

    def advance(self, group: int) -> None:
        """Make `group` current: every older group's call is refused from now on."""
        if group < self._group:
            raise ValueError(f"group {group} is older than the current group {self._group}")
        if group != self._group:
            self._group = group
            self._values.clear()  # an old group's reports are never read again

    def _stale(self, group: int) -> str | None:
        if group < self._group:
            return (
                f"rank-actor group {group} was replaced by group {self._group} "
                "(in-place restart): fenced"
            )
        if group > self._group:
            return f"group {group} is not started yet (current {self._group})"
        return None

    def check(self, group: int) -> Reply:
        """`{}` when `group` is current, else `{"fenced": reason}` (the commit fence)."""
        reason = self._stale(group)
        return {"fenced": reason} if reason else {}

    # -- the Coordinator protocol, one call each ---------------------------------------

    def put(self, group: int, key: str, value: dict[str, typing.Any]) -> Reply:
        """publish / broadcast: set `key` (last write wins, like a store set)."""
        reason = self._stale(group)
        if reason:
            return {"fenced": reason}
        self._values[key] = value
        return {}

    def get(self, group: int, key: str) -> Reply:
        """wait_for / poll: the value of `key`, or `{"missing": True}`."""
        reason = self._stale(group)
        if reason:
            return {"fenced": reason}
        if key not in self._values:
            return {"missing": True}
        return {"value": self._values[key]}

    def get_all(self, group: int, keys: list[str]) -> Reply:
        """gather: every value of `keys` in order, or `{"missing": True}` if any is absent."""
        reason = self._stale(group)
        if reason:
            return {"fenced": reason}
        if any(k not in self._values for k in keys):
            return {"missing": True}
        return {"values": [self._values[k] for k in keys]}

    def propose(self, group: int, key: str, value: dict[str, typing.Any]) -> Reply:
        """Set `key` unless set; the value that won."""
        reason = self._stale(group)
        if reason:
            return {"fenced": reason}
        won = self._values.setdefault(key, value)
        if "manifest" in value and won.get("manifest") == value["manifest"]:
            # Rank 0 proposes the manifest once it committed (shared volume).
            # Node-local volumes (the doc carries rank 0's `.metadata`): it
            # proposes it FIRST so the other ranks commit their copies, then
            # commits its own last and proposes again; a group killed in
            # between committed nothing (both copies stay temporary folders,
            # seen on the devcluster: fromStep 15, restored from 10), so only
            # the second proposal counts.
            if "metadata" not in value or key in self._proposed:
                self._note_commit(key)
            self._proposed.add(key)
        return {"value": won}

    def _note_commit(self, key: str) -> None:
        match = _COMMITTED_RE.search(key)
        if match:
            step = int(match.group(1))
            self._committed = step if self._committed is None else max(self._committed, step)

    # -- driver side ------------------------------------------------------------------

    def last_committed(self) -> int | None:
        """The newest step a group of this attempt committed (None: none yet)."""
        return self._committed

    def request_preemption(self) -> None:
        """The head got SIGTERM: ranks deliver SIGTERM to themselves on their next poll."""
        if self._preempt_at is None:
            self._preempt_at = time.time()

    def preemption(self) -> float | None:
        """When preemption was requested (epoch seconds), None if not."""
        return self._preempt_at
