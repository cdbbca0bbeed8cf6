"""What the driver does when the rank-actor group ends: pure decisions.

| what happened | decision |
| --- | --- |
| every rank returned 0 | exit 0 |
| a rank returned CONFIG_ERROR (78) | exit 78 (never retried) |
| the ranks stopped for preemption (143) | exit 143 |
| a rank raised or returned another code | exit that code (1 for an exception): restartPolicy decides |
| a rank actor died, its node alive, budget left, not preempting | in-place restart: new group |
| a rank actor died, budget spent | exit RETRYABLE: the operator's gang restart |
| a node of the group is gone, budget left, not preempting | in-place restart once a replacement node joined (`replace_nodes`) |
| a node of the group is gone, budget spent or preempting | exit RETRYABLE: the operator's gang restart |
| no replacement node joined in time (the driver's wait) | exit RETRYABLE |
| preempting and the ranks did not finish in the grace period | exit RETRYABLE |
| (before any group) the placement group cannot be placed | exit RETRYABLE (driver) |
"""

from __future__ import annotations

import dataclasses
import typing

from cairn.api import exitcodes, podenv

RETRYABLE_EXIT_CODE = 75
"""sysexits.h EX_TEMPFAIL: the driver gave up in place (budget spent, node
lost); any failure code other than 78 and 143 makes the operator restart the
pods (restartPolicy), 75 names why in the log."""

Kind = typing.Literal["finished", "rank_died", "node_lost", "failed", "timed_out"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GroupEnd:
    """How one group ended, as the driver saw it."""

    kind: Kind
    codes: tuple[int | None, ...] = ()
    """Each rank's return code (None: did not return)."""
    rank: int | None = None
    """The rank whose death or failure ended the group."""
    reason: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    restart: bool
    exit_code: int
    reason: str
    replace_nodes: bool = False
    """The new group needs a new placement: a node of the old one is gone
    (the operator replaces its pod; the driver waits for the new Ray node)."""


def decide(end: GroupEnd, *, restarts_done: int, budget: int, preempting: bool) -> Decision:
    """The next move after `end` (see the module's table)."""
    if end.kind == "finished":
        return Decision(restart=False, exit_code=_combined(end.codes), reason="ranks returned")
    if end.kind == "failed":
        return Decision(restart=False, exit_code=1, reason=end.reason or "a rank failed")
    if end.kind == "node_lost":
        if preempting or restarts_done >= budget:
            why = (
                "the job is stopping"
                if preempting
                else f"the in-place restart budget ({budget}) is spent"
            )
            return Decision(
                restart=False,
                exit_code=RETRYABLE_EXIT_CODE,
                reason=f"a Ray node is gone ({end.reason}) and {why}: pod-level restart",
            )
        return Decision(
            restart=True,
            exit_code=0,
            reason=(
                f"a Ray node is gone ({end.reason}): in-place restart "
                f"{restarts_done + 1}/{budget} once its replacement joins"
            ),
            replace_nodes=True,
        )
    if end.kind == "timed_out":
        return Decision(restart=False, exit_code=RETRYABLE_EXIT_CODE, reason=end.reason)
    # rank_died
    if preempting:
        return Decision(
            restart=False,
            exit_code=RETRYABLE_EXIT_CODE,
            reason=f"rank {end.rank} died during the final checkpoint ({end.reason})",
        )
    if restarts_done >= budget:
        return Decision(
            restart=False,
            exit_code=RETRYABLE_EXIT_CODE,
            reason=(
                f"rank {end.rank} died ({end.reason}) and the in-place restart budget "
                f"({budget}) is spent: pod-level restart"
            ),
        )
    return Decision(
        restart=True,
        exit_code=0,
        reason=f"rank {end.rank} died ({end.reason}): in-place restart {restarts_done + 1}/{budget}",
    )


def group_resume_env(env: typing.Mapping[str, str], *, committed: int | None) -> dict[str, str]:
    """`env` for a rank-actor group, with the attempt's resume target dropped once
    it is spent (pure).

    The operator gives the head pod the attempt's target (``CAIRN_RESUME_FROM``:
    an explicit step, an import, ``none``; ``CAIRN_RESUME_SHA256`` pinning it)
    and the driver forwards it to every group. A later group of the same
    attempt that loaded it again would roll the job back to it once more,
    superseding what the earlier groups committed. The target is spent once a
    group of this attempt committed a step (`committed`, the monitor's): the
    lineage decision after the restore comes before the first save
    (`cairn.checkpoint.lineage`), so from then on the newest committed step is
    the one to resume (``latest``). Before any commit the target is tried again.
    (torchrun's agents cannot tell this on every node, so the API refuses an
    explicit target with torchrun's in-place restarts.)"""
    out = dict(env)
    if committed is not None and out.get(podenv.RESUME_FROM, "latest") != "latest":
        out[podenv.RESUME_FROM] = "latest"
        out.pop(podenv.RESUME_SHA256, None)
    return out


def _combined(codes: tuple[int | None, ...]) -> int:
    """One exit code for the ranks' return codes: config error first, then preempted."""
    known = [c for c in codes if c is not None]
    if exitcodes.CONFIG_ERROR in known:
        return exitcodes.CONFIG_ERROR
    failures = [c for c in known if c not in (0, exitcodes.PREEMPTED)]
    if failures:
        return failures[0]
    if exitcodes.PREEMPTED in known:
        return exitcodes.PREEMPTED
    return 0
