"""Runtime ray against the real API server and the running operator.

Covers: the CRD's CEL refuses ``spec.ray`` without ``runtime: ray``, a Ray job
without a command, and a runtime change while the job runs (allowed while
suspended); a Ray pod's launcher refusing the image's Ray version fails the job
at once as ConfigurationError with the launcher's message (exit 78, no restart
spent); with a one-node Ray job running (the real launcher and ``ray start
--head`` in the pod), the trainer's token may write ``status.ray`` (the
ValidatingAdmissionPolicy) but still not ``phase``; the operator posts one
``InPlaceRestart`` Event naming the group, the reason and the step, records it
in ``status.ray.announcedInPlaceRestarts``, leaves the phase Running, and sets
``status.ray.group`` back to 0 when a deleted pod starts attempt 2; the job's
Ray token Secret (owned, immutable, 64 hex characters, in no status or Event)
with which its head runs.
"""

import base64
import json
import re
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests.integration.devcluster import kube_helpers as kh
from tests.integration.operator.conftest import (
    GROUP,
    PLURAL,
    SLEEP_FOREVER,
    VERSION,
    WAIT,
    Kube,
    job_body,
)

pytestmark = pytest.mark.cluster


def _ray_body(name: str, **spec: Any) -> dict[str, Any]:
    return job_body(name, script=SLEEP_FOREVER, nodes=1, runtime="ray", **spec)


def _invalid(kube: Kube, body: dict[str, Any], needle: str) -> None:
    with pytest.raises(ApiException) as caught:
        kube.create(body)
    assert caught.value.status == 422, caught.value
    assert needle in str(caught.value.body)


def test_cel_rules(kube: Kube) -> None:
    torchrun = job_body("plain", script=SLEEP_FOREVER, nodes=1, ray={"numCpus": 1})
    _invalid(kube, torchrun, "spec.ray is allowed only with runtime: ray")
    no_command = _ray_body("nocmd")
    del no_command["spec"]["command"]
    _invalid(kube, no_command, "runtime: ray needs spec.command")
    suspended = kube.create(_ray_body("later", suspend=True))
    assert suspended["spec"]["runtime"] == "ray"
    kube.patch_spec("later", {"runtime": "torchrun"})
    kube.patch_spec("later", {"runtime": "ray", "suspend": False})
    with pytest.raises(ApiException) as caught:
        kube.patch_spec("later", {"runtime": "torchrun"})
    assert caught.value.status == 422
    assert "spec.runtime can only change while the job is suspended" in str(caught.value.body)


def test_wrong_ray_version_is_a_configuration_error(kube: Kube) -> None:
    kube.create(_ray_body("oldray", ray={"version": "2.9.3"}))
    status = kube.wait_phase("oldray", "Failed")
    failure = status["lastFailure"]
    assert failure["reason"] == "ConfigurationError" and failure["exitCode"] == 78
    assert "spec.ray.version is 2.9.3 but the image has ray" in failure["message"]
    assert status["restarts"] == 0


def _patch_as_trainer(custom: client.CustomObjectsApi, kube: Kube, status: dict[str, Any]) -> None:
    custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, kube.namespace, PLURAL, "rayjob", {"status": status}
    )


def _check_ray_token_secret(kube: Kube, job: str) -> None:
    """The job's Ray token: owned by the job, immutable, 32 random bytes as hex,
    and nowhere in the job or its Events (the running head started Ray with it)."""
    secret = kube.core.read_namespaced_secret(f"{job}-ray-token", kube.namespace)
    (owner,) = secret.metadata.owner_references
    assert owner.controller and owner.uid == kube.job(job)["metadata"]["uid"]
    assert secret.immutable is True
    token = base64.b64decode(secret.data["token"]).decode()
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    assert token not in json.dumps(kube.job(job))
    assert not any(token in (e.message or "") for e in kube.events(job))


def test_in_place_restart_event_and_group_reset(kube: Kube) -> None:
    kube.create(_ray_body("rayjob"))
    kube.wait_phase("rayjob", "Running", attempt=1)
    assert kube.status("rayjob")["ray"] == {"group": 0}
    _check_ray_token_secret(kube, "rayjob")
    custom = client.CustomObjectsApi(kube.as_service_account("rayjob-trainer", pod="rayjob-a1-n0"))
    ray = {
        "group": 1,
        "inPlaceRestarts": 1,
        "lastInPlaceRestart": {
            "time": "2026-11-23T10:00:00Z",
            "reason": "rank 0 actor died",
            "fromStep": 5,
        },
    }

    def written() -> bool:
        try:
            _patch_as_trainer(custom, kube, {"ray": ray})
        except ApiException as exc:  # the RoleBinding may not be in RBAC's cache yet
            if exc.status == 403 and "ValidatingAdmissionPolicy" not in str(exc.body):
                return False
            raise
        return True

    kh.wait_for(written, timeout=WAIT, what="the trainer token writing status.ray")
    with pytest.raises(ApiException) as caught:
        _patch_as_trainer(custom, kube, {"phase": "Succeeded"})
    assert caught.value.status == 403
    event = kube.wait_event("rayjob", "InPlaceRestart")
    assert event.type == "Normal"
    assert event.message == (
        "in-place restart 1, rank-actor group 1 restores from step 5: rank 0 actor died"
    )
    status = kube.wait_status(
        "rayjob",
        "announcedInPlaceRestarts 1",
        lambda s: s.get("ray", {}).get("announcedInPlaceRestarts") == 1,
    )
    assert status["phase"] == "Running"
    assert status["ray"]["inPlaceRestarts"] == 1 and status["ray"]["group"] == 1
    assert [e.reason for e in kube.events("rayjob")].count("InPlaceRestart") == 1

    (pod,) = kube.pods("rayjob", attempt=1)
    kube.core.delete_namespaced_pod(pod.metadata.name, kube.namespace, grace_period_seconds=0)
    status = kube.wait_status(
        "rayjob", "attempt 2", lambda s: s.get("attempt") == 2, timeout=WAIT * 2
    )
    assert status["ray"]["group"] == 0
    assert status["ray"]["inPlaceRestarts"] == 1
    assert [e.reason for e in kube.events("rayjob")].count("InPlaceRestart") == 1
