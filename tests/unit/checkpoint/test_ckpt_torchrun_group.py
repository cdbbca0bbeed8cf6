"""torchrun's worker group as the writer's fencing generation, pure.

Covers: the group from TORCHELASTIC_RESTART_COUNT (garbled or absent: 0;
CAIRN_RAY_GROUP wins under the Ray driver); the ApiFence
refuses a stale torchrun group at our attempt only, and reads status.ray for
Ray jobs only; the status.torchrun patch bumps group and inPlaceRestarts (by one per
recorded group, however far the sum moved),
never for an older or equal group or another attempt; every rank agrees on
the group (the sum of every node's restart count), gathered only when
torchrun may restart.
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


def test_the_group_is_the_sum_of_every_nodes_restarts(tmp_path: Any) -> None:
    # Node 1's worker died twice, node 0's once: group 3 on every rank.
    opts = options.CheckpointOptions(directory=tmp_path, attempt=1)
    peers = _Peers([2, "garbled"])  # type: ignore[list-item]
    got = wiring.with_torchrun_group(opts, coordinator=peers, environ=_restarted(1))  # type: ignore[arg-type]
    assert got.group == 3 and peers.published == [{"restarts": 1}]


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
