"""``spec.ttlSecondsAfterFinished`` on the devcluster.

Covers: a job that Succeeded and one that Failed, each with a TTL, are
deleted by the operator (a ``TTLExpired`` Event names the field), their pods
go with them; a finished job without a TTL stays (checked after the others
are gone); the TTL field round-trips through the API server.
"""

import functools

import pytest
from kubernetes.client.rest import ApiException

from tests.integration.devcluster import kube_helpers as kh
from tests.integration.operator.conftest import WAIT, Kube, job_body

pytestmark = pytest.mark.cluster


def _gone(kube: Kube, name: str) -> bool:
    try:
        kube.job(name)
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return False


def test_finished_jobs_are_deleted_after_their_ttl(kube: Kube) -> None:
    no_retry = {"maxRestarts": 0, "backoffSeconds": 1, "maxBackoffSeconds": 1}
    kube.create(job_body("done", script="pass", nodes=1, ttlSecondsAfterFinished=2))
    kube.create(
        job_body(
            "broke",
            script="raise SystemExit(3)",
            nodes=1,
            ttlSecondsAfterFinished=2,
            restartPolicy=no_retry,
        )
    )
    kube.create(job_body("kept", script="pass", nodes=1))
    assert kube.job("done")["spec"]["ttlSecondsAfterFinished"] == 2
    kube.wait_phase("kept", "Succeeded")
    for name in ("done", "broke"):
        kh.wait_for(
            functools.partial(_gone, kube, name), timeout=WAIT, what=f"{name} deleted by its TTL"
        )
        event = kube.wait_event(name, "TTLExpired")
        assert "spec.ttlSecondsAfterFinished" in event.message
        kube.wait_no_pods(name)
    assert kube.status("kept")["phase"] == "Succeeded"
    assert "ttlSecondsAfterFinished" not in kube.job("kept")["spec"]
