"""Runtime torchrun's in-place restarts on the operator side, pure.

Covers: ``spec.torchrun`` allowed only with runtime torchrun, a budget only
with at most 10 nodes and no explicit resume target; default 0 keeps
today's env exactly (static rendezvous on the master, PET_MAX_RESTARTS 0);
a budget > 0 switches to c10d rendezvous (rank 0 hosts it, one run id per
attempt, no PET_MASTER_*); ``status.torchrun.group`` reset on a new attempt
only when one was recorded; one InPlaceRestart Event per growth of
``status.torchrun.inPlaceRestarts`` in the same words as Ray's, announced once.
"""

from typing import Any

import pydantic
import pytest

from cairn.api import podenv, trainingjob
from cairn.operator.core import builders, jobobserve, jobplan, k8stypes, raystatus

from . import jobs
from .test_plan_lifecycle import _run


def _env(pod: k8stypes.Pod) -> dict[str, Any]:
    container = pod["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _pod_env(job: trainingjob.TrainingJob, *, rank: int) -> dict[str, Any]:
    return _env(builders.pod(job, attempt=3, rank=rank, resume=podenv.ResumeTarget(kind="latest")))


def _with_torchrun_status(job: Any, torchrun: dict[str, Any]) -> Any:
    raw = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    raw["status"]["torchrun"] = {**raw["status"].get("torchrun", {}), **torchrun}
    return type(job).model_validate(raw)


def test_spec_torchrun_is_refused_with_runtime_ray() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"spec\.torchrun is allowed only"):
        jobs.job(runtime="ray", command=["python"], torchrun={"maxInPlaceRestarts": 1})


@pytest.mark.parametrize("resume", [{"step": 10}, {"none": True}, {"uri": "s3://bucket/x"}])
def test_an_explicit_resume_target_is_refused_with_a_budget(resume: dict[str, Any]) -> None:
    checkpoint: dict[str, Any] = {"resume": resume}
    if "uri" in resume:
        checkpoint["upload"] = {"uri": "s3://bucket/run"}
    with pytest.raises(pydantic.ValidationError, match=r"needs checkpoint\.resume unset"):
        jobs.job(torchrun={"maxInPlaceRestarts": 1}, checkpoint=checkpoint)
    assert jobs.job(torchrun={"maxInPlaceRestarts": 0}, checkpoint=checkpoint)


def test_more_than_ten_nodes_are_refused_with_a_budget() -> None:
    with pytest.raises(pydantic.ValidationError, match=r"needs nodes <= 10"):
        jobs.job(nodes=11, torchrun={"maxInPlaceRestarts": 1})
    assert jobs.job(nodes=10, torchrun={"maxInPlaceRestarts": 1}).spec.nodes == 10


def test_default_budget_keeps_static_rendezvous_and_no_restarts() -> None:
    env = _pod_env(jobs.job(), rank=1)
    assert env[podenv.PET_MAX_RESTARTS] == "0"
    assert env[podenv.PET_MASTER_PORT] == str(podenv.MASTER_PORT_DEFAULT)
    assert podenv.PET_MASTER_ADDR in env
    assert not any(name.startswith("PET_RDZV_") for name in env)
    explicit_zero = _pod_env(jobs.job(torchrun={"maxInPlaceRestarts": 0}), rank=1)
    assert explicit_zero == env


def test_a_budget_switches_to_c10d_rendezvous_hosted_by_rank_0() -> None:
    job = jobs.job(torchrun={"maxInPlaceRestarts": 2})
    head, worker = _pod_env(job, rank=0), _pod_env(job, rank=1)
    for env in (head, worker):
        assert env[podenv.PET_MAX_RESTARTS] == "2"
        assert env[podenv.PET_RDZV_BACKEND] == "c10d"
        assert env[podenv.PET_RDZV_ENDPOINT] == (
            f"{env[podenv.MASTER_ADDR]}:{podenv.MASTER_PORT_DEFAULT}"
        )
        assert env[podenv.PET_RDZV_ID] == f"{job.metadata.uid}-a3"
        assert podenv.PET_MASTER_ADDR not in env and podenv.PET_MASTER_PORT not in env
    beats = "keep_alive_interval=1,keep_alive_max_attempt=5"
    assert (head[podenv.PET_RDZV_CONF], worker[podenv.PET_RDZV_CONF]) == (
        f"is_host=1,{beats}",
        f"is_host=0,{beats}",
    )


def test_group_is_reset_on_a_new_attempt_only_when_recorded() -> None:
    result, job = _run(jobs.job(torchrun={"maxInPlaceRestarts": 2}))
    assert result.status is not None and "torchrun" not in result.status
    job = _with_torchrun_status(
        job, {"group": 2, "inPlaceRestarts": 2, "announcedInPlaceRestarts": 2}
    )
    result, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=1)
    assert "torchrun" not in (result.status or {})
    killed = jobs.pod(1, 1, "Failed", exit_code=1, finished_at=jobs.at(5))
    _result, job = _run(job, jobs.pod(1, 0), killed, t=6)
    _result, job = _run(job, t=60)
    assert job.status.attempt == 2
    assert job.status.torchrun is not None and job.status.torchrun.group == 0


def test_in_place_restart_is_announced_once_in_rays_words() -> None:
    _, job = _run(jobs.job(torchrun={"maxInPlaceRestarts": 2}))
    _, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=1)
    job = _with_torchrun_status(
        job,
        {
            "group": 1,
            "inPlaceRestarts": 1,
            "lastInPlaceRestart": {"time": "2026-11-27T12:00:10Z", "reason": "r", "fromStep": 10},
        },
    )
    pods = jobobserve.Observed(pods=(jobs.pod(1, 0), jobs.pod(1, 1)))
    result = jobplan.plan(job=job, observed=pods, now=jobs.at(11))
    (event,) = result.events
    assert event.reason == raystatus.EVENT_REASON
    assert event.message == "in-place restart 1, torchrun worker group 1 restores from step 10: r"
    assert result.status is not None
    assert result.status["torchrun"] == {"announcedInPlaceRestarts": 1}
    assert "ray" not in result.status
    job = _with_torchrun_status(jobs.patched(job, result), {"announcedInPlaceRestarts": 1})
    again = jobplan.plan(job=job, observed=pods, now=jobs.at(12))
    assert again.events == () and again.status is None
    assert job.status.phase == "Running"
