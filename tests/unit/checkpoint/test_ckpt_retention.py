"""Retention policies (cairn.api.retention), table-tested.

Covers local rotation (keepLast, byte budget, protected newest / in-flight /
not-uploaded steps, abandoned partials) and remote retention (keepLast plus
keepEvery milestones), and the manifest-first deletion order.
"""

from __future__ import annotations

import pytest

from cairn.api import retention

R = retention.StepRecord


def local(records: list[retention.StepRecord], **kw: object) -> retention.LocalPlan:
    args: dict[str, object] = {
        "in_flight": frozenset(),
        "keep_last": 2,
        "max_bytes": None,
        "upload_enabled": False,
    }
    args.update(kw)
    return retention.plan_local(steps=records, **args)  # type: ignore[arg-type]


def committed(*steps: int, size: int = 10, uploaded: bool = True) -> list[retention.StepRecord]:
    return [R(step=s, committed=True, bytes=size, uploaded=uploaded) for s in steps]


@pytest.mark.parametrize(
    ("records", "kw", "delete", "partial"),
    [
        (committed(1, 2, 3, 4), {}, (1, 2), ()),
        (committed(1, 2, 3, 4), {"keep_last": 3}, (1,), ()),
        (committed(1, 2), {}, (), ()),
        ([], {}, (), ()),
        # byte budget: 25 bytes fits two 10-byte steps only
        (committed(1, 2, 3), {"keep_last": 3, "max_bytes": 25}, (1,), ()),
        # the newest committed step is kept even when it alone exceeds the budget
        (committed(1, 2, size=100), {"max_bytes": 50}, (1,), ()),
        # in-flight steps are never deleted
        (committed(1, 2, 3), {"in_flight": frozenset({1})}, (), ()),
        # with upload on, not-yet-uploaded steps stay
        (
            [*committed(1, uploaded=False), *committed(2, 3)],
            {"upload_enabled": True},
            (),
            (),
        ),
        ([*committed(1, uploaded=False), *committed(2, 3)], {}, (1,), ()),
        # partials: this job's abandoned ones go, in-flight ones stay
        ([*committed(1, 2), R(step=3, committed=False, own_partial=True)], {}, (), (3,)),
        (
            [*committed(1, 2), R(step=3, committed=False, own_partial=True)],
            {"in_flight": frozenset({3})},
            (),
            (),
        ),
        # an uncommitted folder not proven to be ours (foreign, unknown) stays
        ([*committed(1, 2), R(step=3, committed=False)], {}, (), ()),
    ],
)
def test_plan_local(
    records: list[retention.StepRecord],
    kw: dict[str, object],
    delete: tuple[int, ...],
    partial: tuple[int, ...],
) -> None:
    plan = local(records, **kw)
    assert plan.delete_committed == delete
    assert plan.delete_partial == partial


@pytest.mark.parametrize(
    ("records", "kw", "over"),
    [
        # S3 down: nothing uploaded, so nothing may go; the excess is reported
        (committed(1, 2, 3, 4, uploaded=False), {"upload_enabled": True}, (1, 2)),
        (
            committed(1, 2, 3, size=10, uploaded=False),
            {"upload_enabled": True, "keep_last": 3, "max_bytes": 15},
            (1, 2),
        ),
        # uploaded steps beyond the budget are deleted, not reported
        (committed(1, 2, 3, 4), {"upload_enabled": True}, ()),
        # the newest step alone over maxBytes is not a backlog
        (committed(1, size=100), {"max_bytes": 50}, ()),
    ],
)
def test_plan_local_reports_protected_steps_over_budget(
    records: list[retention.StepRecord], kw: dict[str, object], over: tuple[int, ...]
) -> None:
    plan = local(records, **kw)
    assert plan.over_budget == over
    assert not set(plan.over_budget) & set(plan.delete_committed)
    assert plan.kept_bytes == sum(r.bytes for r in records if r.step in plan.kept)


def test_plan_local_refuses_keep_last_below_two() -> None:
    with pytest.raises(ValueError, match="keep_last"):
        local(committed(1), keep_last=1)


@pytest.mark.parametrize(
    ("steps", "keep_last", "keep_every", "delete"),
    [
        ([100, 200, 300, 400], 2, None, (100, 200)),
        ([100, 200, 300, 400, 500], 1, 200, (100, 300)),
        ([100], 1, None, ()),
        ([50, 100, 150], 5, 100, ()),
    ],
)
def test_plan_remote(
    steps: list[int], keep_last: int, keep_every: int | None, delete: tuple[int, ...]
) -> None:
    records = [R(step=s, committed=True) for s in steps] + [R(step=999, committed=False)]
    assert (
        retention.plan_remote(steps=records, keep_last=keep_last, keep_every=keep_every) == delete
    )


def test_deletion_order_puts_manifest_first() -> None:
    paths = ["p/step-1/__1_0.distcp", "p/step-1/manifest.json", "p/step-1/.metadata"]
    assert retention.deletion_order(paths)[0] == "p/step-1/manifest.json"
