"""Runtime torchrun: the worker group as a fencing generation, and its record in status.

torchrun's elastic agent (``--max-restarts``, set from
``spec.torchrun.maxInPlaceRestarts``) restarts its workers in the same pod
when one dies, and gives each new worker group ``TORCHELASTIC_RESTART_COUNT``
(0 for the first). Under c10d each node's agent counts only its own
workers' failures, and an agent of a pod the operator replaced in place
starts counting at 0 again, so no single count, nor their sum, is a
generation. ``agreed`` is (``wiring.with_torchrun_group``, one gather):
every rank reports its count, its pod's UID and what its fence file says
of this attempt (the group that last started there and its ``members``);
if every rank's record names the same group run by the same members (each
rank's pod and count), this manager belongs to that group; if no rank has
a record, this is the attempt's first group (the sum: 0); otherwise it is a
new group, one above the newest recorded (at least the sum). So a group
never repeats an older one's number, even after a pod was replaced, and a
writer's identity (attempt, group) lets the local fence file and
``ApiFence`` refuse a stale group, as ``CAIRN_RAY_GROUP`` does for Ray.

Rank 0 of a restarted group records it in ``status.torchrun`` (same
vocabulary as ``status.ray``: ``group``, ``inPlaceRestarts``,
``lastInPlaceRestart``) before its first commit; the operator posts the
``InPlaceRestart`` Event. ``inPlaceRestarts`` counts recorded worker groups
(one per restart; a group whose record the API refused is not counted),
``group`` is the fencing generation, which can grow by more than one per restart.
Without API access the local fence alone protects.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import typing
from collections.abc import Mapping, Sequence

log = logging.getLogger(__name__)

RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
"""Set by torchrun's agent in every worker: the worker group's restart count."""
REASON = "a worker process exited; torchrun restarted the worker group in place"

PatchFn = typing.Callable[[dict[str, typing.Any]], None]
ReadFn = typing.Callable[[], dict[str, typing.Any] | None]


def group_from_env(env: Mapping[str, str]) -> int:
    """The worker group torchrun runs (0 when absent or garbled). Pure."""
    raw = env.get(RESTART_COUNT_ENV, "")
    try:
        value = int(raw)
    except ValueError:
        return 0
    return max(value, 0)


def _count(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return max(value, 0)
    return 0


def members(reports: Sequence[Mapping[str, typing.Any]]) -> str:
    """Who runs a worker group: each rank's pod UID and restart count, hashed
    (the fence file keeps it; equal only for the same processes' group). Pure."""
    who = [[str(r.get("pod") or ""), _count(r.get("restarts"))] for r in reports]
    return hashlib.sha256(json.dumps(who).encode()).hexdigest()[:16]


def agreed(reports: Sequence[Mapping[str, typing.Any]]) -> tuple[int, str]:
    """(group, members) from every rank's report, in rank order. Pure.

    A report: ``restarts`` (TORCHELASTIC_RESTART_COUNT), ``pod`` (its pod's
    UID), ``fenced`` and ``fencedMembers`` (its fence file's group and members
    for this attempt of this job; None: no record)."""
    who = members(reports)
    total = sum(_count(r.get("restarts")) for r in reports)
    fenced = [r.get("fenced") for r in reports]
    groups = [g for g in fenced if isinstance(g, int) and not isinstance(g, bool)]
    if not groups:
        return total, who  # the attempt's first group
    same = len(groups) == len(reports) and len(set(groups)) == 1
    if same and all(r.get("fencedMembers") == who for r in reports):
        return groups[0], who  # another manager of the group that runs
    return max(total, max(groups) + 1), who


def _int_field(status: Mapping[str, typing.Any], key: str) -> int:
    value = status.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def restart_body(
    job: Mapping[str, typing.Any] | None,
    *,
    attempt: int,
    group: int,
    from_step: int | None,
    now: datetime.datetime,
) -> dict[str, typing.Any] | None:
    """The merge patch announcing `group`; None when status already has it (or newer,
    or this attempt is not the job's current one). Pure."""
    status = (job or {}).get("status") or {}
    if _int_field(status, "attempt") != attempt:
        return None  # another attempt's status: never ours to write
    torchrun = status.get("torchrun") or {}
    recorded = _int_field(torchrun, "group")
    if group <= recorded:
        return None
    return {
        "status": {
            "torchrun": {
                "group": group,
                # One worker group started: one restart, however far the sum
                # of the agents' counts moved (a kill fails the worker of the
                # killed rank and, on the broken connection, often its peers':
                # each agent counts its own, so one kill can add 2 to the sum).
                "inPlaceRestarts": _int_field(torchrun, "inPlaceRestarts") + 1,
                "lastInPlaceRestart": {
                    "time": now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                    "reason": REASON,
                    "fromStep": from_step,
                },
            }
        }
    }


def record(
    *, patch: PatchFn, read: ReadFn, attempt: int, group: int, from_step: int | None
) -> bool:
    """Record `group` in status.torchrun; False (logged) when the API refused or failed."""
    try:
        body = restart_body(
            read(),
            attempt=attempt,
            group=group,
            from_step=from_step,
            now=datetime.datetime.now(datetime.UTC),
        )
        if body is not None:
            patch(body)
    except Exception as exc:  # the API is a second fence; the local fence still fences
        log.warning("could not record torchrun worker group %d in status: %s", group, exc)
        return False
    log.info("torchrun worker group %d (in-place restart) recorded in status", group)
    return True
