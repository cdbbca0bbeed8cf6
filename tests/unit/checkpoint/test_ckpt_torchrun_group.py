"""torchrun's worker group as the writer's fencing generation, pure.

Covers: the group from TORCHELASTIC_RESTART_COUNT (garbled or absent: 0;
CAIRN_RAY_GROUP wins under the Ray driver); the ApiFence
refuses a stale torchrun group at our attempt only, and reads status.ray for
Ray jobs only; the status.torchrun patch bumps group and inPlaceRestarts (by one per
recorded group, however far the sum moved),
never for an older or equal group or another attempt; every rank agrees on
the group (gathered only when torchrun may restart): the sum of every
node's restart count for the attempt's first group, the same number for
another manager of the running group (same pods, same counts), and one
above the newest recorded group for a new one, also when a replaced pod's
agent counts from 0 again (the generation never repeats).
"""

import datetime
from typing import Any

import pytest

from cairn.checkpoint import fence, options, runtime_config, torchrun_group, wiring

NOW = datetime.datetime(2026, 11, 27, 12, 0, tzinfo=datetime.UTC)
UID = "uid-1"


def _job(*, attempt: int = 1, runtime: str | None = None, **status: Any) -> dict[str, Any]:
    spec = {} if runtime is None else {"runtime": runtime}
    return {"metadata": {"uid": UID}, "spec": spec, "status": {"attempt": attempt, **status}}


@pytest.mark.parametrize(
    ("env", "group"),
    [
        ({}, 0),
        ({"TORCHELASTIC_RESTART_COUNT": "2"}, 2),
        ({"TORCHELASTIC_RESTART_COUNT": "x"}, 0),
        ({"TORCHELASTIC_RESTART_COUNT": "-3"}, 0),
        ({"TORCHELASTIC_RESTART_COUNT": "2", "CAIRN_RAY_GROUP": "5"}, 5),
    ],
)
def test_group_from_the_environment(env: dict[str, str], group: int) -> None:
    assert runtime_config.from_env(env).checkpoint.group == group


def test_api_fence_refuses_a_stale_torchrun_group_at_our_attempt_only() -> None:
    job = _job(torchrun={"group": 2})
    reason = fence.job_stale_reason(job, job_uid=UID, attempt=1, group=1)
    assert reason is not None and "torchrun worker group is 2" in reason
    assert fence.job_stale_reason(job, job_uid=UID, attempt=1, group=2) is None
    newer = _job(attempt=2, torchrun={"group": 0})
    assert "attempt 2" in (fence.job_stale_reason(newer, job_uid=UID, attempt=1, group=5) or "")


def test_each_runtime_reads_its_own_group() -> None:
    torchrun_job = _job(runtime="torchrun", ray={"group": 3})
    assert fence.job_stale_reason(torchrun_job, job_uid=UID, attempt=1, group=0) is None
    ray_job = _job(runtime="ray", torchrun={"group": 3})
    assert fence.job_stale_reason(ray_job, job_uid=UID, attempt=1, group=0) is None
    ray_stale = _job(runtime="ray", ray={"group": 3})
    assert "rank-actor group" in (
        fence.job_stale_reason(ray_stale, job_uid=UID, attempt=1, group=0) or ""
    )


def test_restart_body_bumps_group_and_count() -> None:
    # One kill can move the sum by 2 (both agents' workers failed): still one restart.
    body = torchrun_group.restart_body(
        _job(torchrun={"group": 1, "inPlaceRestarts": 4}),
        attempt=1,
        group=3,
        from_step=20,
        now=NOW,
    )
    assert body == {
        "status": {
            "torchrun": {
                "group": 3,
                "inPlaceRestarts": 5,
                "lastInPlaceRestart": {
                    "time": "2026-11-27T12:00:00Z",
                    "reason": torchrun_group.REASON,
                    "fromStep": 20,
                },
            }
        }
    }


@pytest.mark.parametrize(
    ("job", "group"),
    [
        (_job(torchrun={"group": 2}), 2),  # already recorded (a second look)
        (_job(torchrun={"group": 3}), 2),  # a newer group recorded: never go back
        (_job(attempt=2), 1),  # another attempt's status
        (None, 1),  # the job is gone
    ],
)
def test_restart_body_writes_nothing_that_is_not_ours(job: Any, group: int) -> None:
    body = torchrun_group.restart_body(job, attempt=1, group=group, from_step=None, now=NOW)
    assert body is None


def test_record_survives_an_api_error() -> None:
    def refuse(_body: dict[str, Any]) -> None:
        raise RuntimeError("forbidden")

    ok = torchrun_group.record(patch=refuse, read=_job, attempt=1, group=1, from_step=None)
    assert ok is False


class _Peers:
    """A coordinator of rank 0 whose peers already published their counts."""

    def __init__(self, peer_counts: list[int]) -> None:
        self.rank, self.world_size = 0, len(peer_counts) + 1
        self.reports = [{"restarts": c} for c in peer_counts]
        self.published: list[dict[str, Any]] = []

    def publish(self, key: str, value: dict[str, Any]) -> None:
        self.published.append(value)

    def gather(self, key: str, *, timeout: float) -> list[dict[str, Any]]:
        return [*self.published, *self.reports]


def _restarted(count: int, *, max_restarts: int = 2, **env: str) -> dict[str, str]:
    return {
        "TORCHELASTIC_RESTART_COUNT": str(count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        **env,
    }


def test_the_first_group_is_the_sum_of_every_nodes_restarts(tmp_path: Any) -> None:
    # No rank has a fence record of this attempt: node 1's worker died twice,
    # node 0's once, so group 3 on every rank.
    opts = options.CheckpointOptions(directory=tmp_path, attempt=1)
    peers = _Peers([2, "garbled"])  # type: ignore[list-item]
    env = _restarted(1, CAIRN_POD_UID="pod-a")
    got = wiring.with_torchrun_group(opts, coordinator=peers, environ=env)  # type: ignore[arg-type]
    assert got.group == 3
    assert peers.published == [
        {"restarts": 1, "pod": "pod-a", "fenced": None, "fencedMembers": None}
    ]
    assert got.group_members == torchrun_group.members(peers.gather("", timeout=1))


def _report(
    restarts: int, pod: str, fenced: int | None, fenced_members: str | None
) -> dict[str, Any]:
    return {"restarts": restarts, "pod": pod, "fenced": fenced, "fencedMembers": fenced_members}


def test_another_manager_of_the_running_group_keeps_its_number() -> None:
    # A second manager in the same worker processes: same pods, same counts,
    # and every rank's fence file names that group and those members.
    who = torchrun_group.members([_report(1, "a", None, None), _report(2, "b", None, None)])
    reports = [_report(1, "a", 5, who), _report(2, "b", 5, who)]
    assert torchrun_group.agreed(reports) == (5, who)


def test_an_in_place_restart_is_one_above_the_newest_recorded_group() -> None:
    old = torchrun_group.members([_report(0, "a", None, None), _report(1, "b", None, None)])
    reports = [_report(0, "a", 4, old), _report(2, "b", 4, old)]  # node b's worker died again
    group, who = torchrun_group.agreed(reports)
    assert group == 5 and who != old


def test_a_replaced_pod_never_repeats_an_older_group() -> None:
    # Node b's agent counted 3 failures (group 3); its pod was lost and replaced
    # in place: the new agent counts from 0 and its volume has no fence file, so
    # the sum (1) went backwards. The group must still be newer than 3.
    old = torchrun_group.members([_report(0, "a", None, None), _report(3, "b", None, None)])
    reports = [_report(1, "a", 3, old), _report(0, "b2", None, None)]
    assert torchrun_group.agreed(reports)[0] == 4


def test_the_same_counts_in_a_new_pod_are_a_new_group() -> None:
    # Even when the counts add up as before (node a counted one more failure,
    # the replaced b's agent one less), the new pod's UID makes it a new group.
    old = torchrun_group.members([_report(0, "a", None, None), _report(1, "b", None, None)])
    reports = [_report(1, "a", 2, old), _report(0, "b2", 2, old)]  # a shared volume's file
    assert torchrun_group.agreed(reports)[0] == 3


def test_disagreeing_records_are_a_new_group() -> None:
    # Rank 1 died before its manager raised its fence for group 2: the ranks'
    # records differ, so this is a new group above both.
    who = torchrun_group.members([_report(0, "a", None, None), _report(1, "b", None, None)])
    reports = [_report(0, "a", 2, who), _report(1, "b", 1, who)]
    assert torchrun_group.agreed(reports)[0] == 3


def test_the_fence_file_carries_the_members_to_the_next_manager(tmp_path: Any) -> None:
    # Real fence files: the first manager of a group raises the fence with its
    # members; a second manager of the same processes reads it back and keeps
    # the group; a peer in a new pod makes the next manager a new group.
    opts = options.CheckpointOptions(directory=tmp_path, attempt=1, job_uid=UID)
    env = _restarted(1, CAIRN_POD_UID="a")
    first = wiring.with_torchrun_group(opts, coordinator=_Peers([0]), environ=env)  # type: ignore[arg-type]
    assert first.group == 1
    fence.raise_local(
        tmp_path, job_uid=UID, attempt=1, group=first.group, members=first.group_members
    )
    assert fence.read_record(tmp_path) == fence.FenceRecord(
        job_uid=UID, attempt=1, group=1, members=first.group_members
    )

    class _Same(_Peers):
        def gather(self, key: str, *, timeout: float) -> list[dict[str, Any]]:
            mine = self.published[0]
            return [mine, {**mine, "restarts": 0, "pod": ""}]

    again = wiring.with_torchrun_group(opts, coordinator=_Same([0]), environ=env)  # type: ignore[arg-type]
    assert (again.group, again.group_members) == (first.group, first.group_members)

    class _Replaced(_Peers):
        def gather(self, key: str, *, timeout: float) -> list[dict[str, Any]]:
            return [self.published[0], _report(0, "b2", None, None)]

    later = wiring.with_torchrun_group(opts, coordinator=_Replaced([0]), environ=env)  # type: ignore[arg-type]
    assert later.group == 2


def test_another_attempts_fence_record_is_not_this_attempts(tmp_path: Any) -> None:
    fence.raise_local(tmp_path, job_uid=UID, attempt=1, group=7, members="x")
    opts = options.CheckpointOptions(directory=tmp_path, attempt=2, job_uid=UID)
    peers = _Peers([0])
    got = wiring.with_torchrun_group(opts, coordinator=peers, environ=_restarted(0))  # type: ignore[arg-type]
    assert got.group == 0 and peers.published[0]["fenced"] is None


@pytest.mark.parametrize(
    "env",
    [
        {},  # not under torchrun
        _restarted(0, max_restarts=0),  # no in-place budget: no store round trip
        _restarted(1, CAIRN_RAY_GROUP="4"),  # the Ray driver's group wins
    ],
)
def test_no_gather_without_an_in_place_budget(tmp_path: Any, env: dict[str, str]) -> None:
    opts = options.CheckpointOptions(directory=tmp_path, attempt=1, group=4 if env else 0)
    peers = _Peers([5])
    got = wiring.with_torchrun_group(opts, coordinator=peers, environ=env)  # type: ignore[arg-type]
    assert got is opts and peers.published == []
