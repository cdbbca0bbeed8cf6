"""Runtime ray on the operator side, pure: pods, lifecycle, status.ray, Events.

Covers: the head/worker pods (launcher command before the user's command,
args unchanged, CAIRN_RUNTIME and CAIRN_RAY_* env with only the set optional
fields, the GCS port on container and Service, the /tmp/ray emptyDir, the
job's Ray token Secret (owned, no data in the plan, created before the pods)
mounted read-only with token auth in the env), a
torchrun job unchanged apart from CAIRN_RUNTIME; the head's success is the
job's (workers still running are stopped); a worker that only echoes the
head's failed driver (FollowsHead) is not the root cause, and the attempt
waits for the head; a killed worker is the root cause and restarts the gang;
``status.ray.group = 0`` on a new attempt only; one InPlaceRestart Event per
growth of ``inPlaceRestarts``, recorded so a repeated look posts nothing; the
operator's status.ray patch never carries the driver's keys.
"""

from typing import Any

from cairn.api import exitcodes, podenv
from cairn.operator.core import builders, jobobserve, jobplan, k8stypes, names, raystatus

from . import jobs
from .test_plan_lifecycle import _run

COMMAND = ["python", "-m", "cairn.trainer.raydriver", "cairn.trainer.reference:main", "--"]


def _ray(**spec: Any) -> dict[str, Any]:
    return {"runtime": "ray", "command": COMMAND, "args": ["--steps", "4"], **spec}


def _env(pod: k8stypes.Pod) -> dict[str, Any]:
    container = pod["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_ray_pods_run_the_launcher_with_the_ray_env() -> None:
    job = jobs.job(**_ray(ray={"numCpus": 2, "version": "2.60.0", "maxInPlaceRestarts": 5}))
    resume = podenv.ResumeTarget(kind="latest")
    head, worker = builders.attempt_pods(job, attempt=2, resume=resume)
    for rank, pod in enumerate((head, worker)):
        container = pod["spec"]["containers"][0]
        assert container["command"] == [
            "python",
            "-m",
            "cairn.trainer.raynode",
            "--",
            *COMMAND,
        ]
        assert container["args"] == ["--steps", "4"]
        env = _env(pod)
        assert env[podenv.RUNTIME] == "ray"
        assert env[podenv.NODE_RANK] == str(rank)
        assert env[podenv.RAY_PORT] == "6379"
        assert env[podenv.RAY_NUM_CPUS] == "2"
        assert env[podenv.RAY_VERSION] == "2.60.0"
        assert env[podenv.RAY_MAX_INPLACE_RESTARTS] == "5"
        assert env[podenv.POD_IP] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert podenv.RAY_NUM_GPUS not in env and podenv.RAY_OBJECT_STORE_BYTES not in env
        assert podenv.RAY_DASHBOARD not in env  # off unless spec.ray.dashboard
        assert env[podenv.MASTER_ADDR_CAIRN] == names.master_addr(
            job="demo", namespace="ml", attempt=2
        )
        assert {"name": "ray-gcs", "containerPort": 6379, "protocol": "TCP"} in container["ports"]
        assert {"name": "cairn-ray", "mountPath": "/tmp/ray"} in container["volumeMounts"]
        assert {"name": "cairn-ray", "emptyDir": {}} in pod["spec"]["volumes"]
        # Head and workers alike: every rank container gets the manifest key.
        key_mount = {
            "name": "cairn-manifest-key",
            "mountPath": podenv.MANIFEST_KEY_DIR,
            "readOnly": True,
        }
        assert key_mount in container["volumeMounts"]
        assert env[podenv.MANIFEST_KEYRING] == f"{podenv.MANIFEST_KEY_DIR}/keyring.json"
    assert _env(head)[podenv.REPORT_STATUS] == "1"
    assert head["spec"]["automountServiceAccountToken"] is True
    assert worker["spec"]["automountServiceAccountToken"] is False
    ports = builders.service(job)["spec"]["ports"]
    assert [p["name"] for p in ports] == ["c10d", "ray-gcs"]


def test_ray_pods_mount_the_jobs_token_and_run_ray_with_token_auth() -> None:
    job = jobs.job(**_ray())
    token_path = f"{podenv.RAY_TOKEN_DIR}/{podenv.RAY_TOKEN_KEY}"
    for pod in builders.attempt_pods(job, attempt=1, resume=podenv.ResumeTarget(kind="latest")):
        container = pod["spec"]["containers"][0]
        env = _env(pod)
        assert env[podenv.RAY_TOKEN_FILE] == token_path
        assert env[podenv.RAY_AUTH_MODE] == "token"
        assert env[podenv.RAY_AUTH_TOKEN_PATH] == token_path
        assert podenv.RAY_AUTH_TOKEN not in env  # the token is never in the pod spec
        mount = {"name": "cairn-ray-token", "mountPath": podenv.RAY_TOKEN_DIR, "readOnly": True}
        assert mount in container["volumeMounts"]
        volume = {
            "name": "cairn-ray-token",
            "secret": {
                "secretName": "demo-ray-token",
                "defaultMode": 0o444,
                "items": [{"key": "token", "path": "token"}],
            },
        }
        assert volume in pod["spec"]["volumes"]


def test_a_requested_dashboard_is_passed_to_the_launcher() -> None:
    job = jobs.job(**_ray(ray={"dashboard": True}))
    pod = builders.pod(job, attempt=1, rank=0, resume=podenv.ResumeTarget(kind="latest"))
    assert _env(pod)[podenv.RAY_DASHBOARD] == "1"


def test_a_ray_job_owns_a_ray_token_secret_created_before_its_pods() -> None:
    job = jobs.job(**_ray())
    children = builders.job_children(job)
    secret = next(c for c in children if c["metadata"]["name"] == "demo-ray-token")
    assert secret["kind"] == "Secret"
    assert "data" not in secret  # jobapply draws the token at create time
    assert secret["metadata"]["ownerReferences"][0]["controller"] is True
    assert secret.get("immutable") is True
    result, _ = _run(job)
    kinds = [(c["kind"], c["metadata"]["name"]) for c in result.creates]
    assert kinds.index(("Secret", "demo-ray-token")) < kinds.index(("Pod", "demo-a1-n0"))


def test_torchrun_pods_have_no_ray_parts() -> None:
    job = jobs.job(command=["torchrun", "train.py"])
    pod = builders.pod(job, attempt=1, rank=0, resume=podenv.ResumeTarget(kind="latest"))
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["torchrun", "train.py"]
    env = _env(pod)
    assert env[podenv.RUNTIME] == "torchrun"
    assert not any(name.startswith("CAIRN_RAY_") for name in env)
    assert [v["name"] for v in pod["spec"]["volumes"]] == [
        "cairn-checkpoints",
        "cairn-manifest-key",
    ]
    assert [p["name"] for p in builders.service(job)["spec"]["ports"]] == ["c10d"]
    assert not any(c["metadata"]["name"].endswith("-ray-token") for c in builders.job_children(job))
    assert not any(name.startswith("RAY_AUTH") for name in env)


def _running_ray(**spec: Any) -> Any:
    _, job = _run(jobs.job(**_ray(**spec)))
    _, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=1)
    assert job.status.phase == "Running"
    return job


def test_head_success_is_the_jobs_and_stops_the_workers() -> None:
    job = _running_ray()
    head = jobs.pod(1, 0, "Succeeded", exit_code=0, finished_at=jobs.at(30))
    worker = jobs.pod(1, 1)
    result, job = _run(job, head, worker, t=31)
    assert job.status.phase == "Succeeded"
    assert [d.name for d in result.deletes] == ["demo-a1-n1"]


def test_worker_failing_after_a_head_success_does_not_fail_the_job() -> None:
    job = _running_ray()
    head = jobs.pod(1, 0, "Succeeded", exit_code=0, finished_at=jobs.at(30))
    worker = jobs.pod(1, 1, "Failed", exit_code=1, finished_at=jobs.at(29))
    _result, job = _run(job, head, worker, t=31)
    assert job.status.phase == "Succeeded"


def _follower(finished: float) -> jobobserve.ObservedPod:
    return jobs.pod(
        1,
        1,
        "Failed",
        exit_code=1,
        finished_at=jobs.at(finished),
        termination_message=f"{exitcodes.FOLLOWS_HEAD_REASON}: the driver exited with code 3",
    )


def test_a_worker_echoing_the_heads_failure_waits_for_the_head() -> None:
    job = _running_ray()
    _result, job = _run(job, jobs.pod(1, 0), _follower(20), t=21)
    assert job.status.phase == "Running"
    head = jobs.pod(1, 0, "Failed", exit_code=3, finished_at=jobs.at(25))
    _result, job = _run(job, head, _follower(20), t=26)
    failure = job.status.last_failure
    assert job.status.phase == "Restarting"
    assert failure is not None and (failure.rank, failure.exit_code) == (0, 3)


def test_a_killed_worker_is_the_root_cause() -> None:
    job = _running_ray()
    killed = jobs.pod(1, 1, "Failed", exit_code=137, finished_at=jobs.at(20))
    head = jobs.pod(1, 0, "Failed", exit_code=75, finished_at=jobs.at(22))
    _result, job = _run(job, head, killed, t=23)
    failure = job.status.last_failure
    assert job.status.phase == "Restarting"
    assert failure is not None and (failure.rank, failure.exit_code) == (1, 137)


def test_the_heads_config_error_fails_the_job() -> None:
    job = _running_ray()
    head = jobs.pod(
        1,
        0,
        "Failed",
        exit_code=78,
        finished_at=jobs.at(5),
        termination_message="ConfigurationError: spec.ray.version is 2.9.3 but the image has "
        "ray 2.60.0",
    )
    _result, job = _run(job, head, _follower(6), t=7)
    assert job.status.phase == "Failed"
    assert job.status.last_failure is not None
    assert "spec.ray.version" in job.status.last_failure.message


def test_group_is_reset_on_a_new_attempt_only() -> None:
    result, job = _run(jobs.job(**_ray()))
    assert result.status is not None and result.status["ray"] == {"group": 0}
    raw = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    raw["status"]["ray"] = {"group": 2, "inPlaceRestarts": 2, "announcedInPlaceRestarts": 2}
    job = type(job).model_validate(raw)
    result, job = _run(job, jobs.pod(1, 0), jobs.pod(1, 1), t=1)
    assert "ray" not in (result.status or {})
    assert job.status.ray is not None and job.status.ray.group == 2
    killed = jobs.pod(1, 1, "Failed", exit_code=137, finished_at=jobs.at(5))
    _result, job = _run(job, jobs.pod(1, 0), killed, t=6)
    _result, job = _run(job, t=60)
    assert job.status.attempt == 2
    assert job.status.ray is not None and job.status.ray.group == 0


def _with_ray_status(job: Any, ray: dict[str, Any]) -> Any:
    raw = job.model_dump(mode="json", by_alias=True, exclude_none=True)
    raw["status"]["ray"] = {**raw["status"].get("ray", {}), **ray}
    return type(job).model_validate(raw)


def _merge_ray(job: Any, result: jobplan.Plan) -> Any:
    """Like the API server: the operator's status.ray keys merged into the driver's."""
    before = job.model_dump(mode="json", by_alias=True, exclude_none=True)["status"].get("ray")
    after = jobs.patched(job, result)
    ray = (result.status or {}).get("ray")
    if ray is None or before is None:
        return after
    return _with_ray_status(after, {**before, **ray})


def test_in_place_restart_is_announced_once() -> None:
    job = _running_ray()
    job = _with_ray_status(
        job,
        {
            "group": 1,
            "inPlaceRestarts": 1,
            "lastInPlaceRestart": {
                "time": "2026-11-22T12:00:10Z",
                "reason": "rank 1 actor died",
                "fromStep": 10,
            },
        },
    )
    result = jobplan.plan(job=job, observed=jobobserve.Observed(pods=_pods()), now=jobs.at(11))
    assert [e.reason for e in result.events] == [raystatus.EVENT_REASON]
    assert result.events[0].message == (
        "in-place restart 1, rank-actor group 1 restores from step 10: rank 1 actor died"
    )
    assert result.status is not None
    assert result.status["ray"] == {"announcedInPlaceRestarts": 1}
    job = _merge_ray(job, result)
    assert job.status.ray is not None and job.status.ray.in_place_restarts == 1
    again = jobplan.plan(job=job, observed=jobobserve.Observed(pods=_pods()), now=jobs.at(12))
    assert again.events == () and again.status is None
    assert job.status.phase == "Running"


def test_several_restarts_between_two_looks_are_one_event() -> None:
    job = _with_ray_status(
        _running_ray(), {"group": 3, "inPlaceRestarts": 3, "announcedInPlaceRestarts": 1}
    )
    result = jobplan.plan(job=job, observed=jobobserve.Observed(pods=_pods()), now=jobs.at(11))
    (event,) = result.events
    assert event.message.startswith("in-place restarts 2-3, rank-actor group 3 restores from")


def test_torchrun_jobs_never_touch_status_ray() -> None:
    result, _job = _run(jobs.job())
    assert result.status is not None and "ray" not in result.status


def _pods() -> tuple[jobobserve.ObservedPod, ...]:
    return (jobs.pod(1, 0), jobs.pod(1, 1))
