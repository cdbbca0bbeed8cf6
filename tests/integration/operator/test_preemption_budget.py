"""Free restarts are bounded: maxPreemptions, and evictions a job causes itself count.

Covers, against the devcluster:
- a job whose pods are evicted again and again (the Eviction API, as a drain
  does: the API server sets DisruptionTarget and deletes the pod) restarts
  without spending maxRestarts, and stops Failed with MaxPreemptionsExceeded
  after maxPreemptions;
- an eviction for the pod's own usage (the kubelet's "Usage of EmptyDir
  volume ... exceeds the limit"): the node agent enforces no sizeLimit, so
  the test writes the status the kubelet would (phase Failed, reason Evicted,
  DisruptionTarget TerminationByKubelet) onto the running pod; it counts
  against maxRestarts (reason Evicted) and the job stops Failed with
  MaxRestartsExceeded;
- the backoff doubles between quick failures and starts over at
  backoffSeconds after an attempt that ran backoffResetSeconds
  (lastFailure.backoffSeconds of each restart).
"""

from typing import Any

import pytest
from kubernetes import client

from tests.integration.operator.conftest import SLEEP_FOREVER, Kube, job_body

pytestmark = pytest.mark.cluster


def _evict(kube: Kube, pod: str) -> None:
    kube.core.create_namespaced_pod_eviction(
        pod,
        kube.namespace,
        client.V1Eviction(metadata=client.V1ObjectMeta(name=pod, namespace=kube.namespace)),
    )


def _failed_reason(status: dict[str, Any]) -> str:
    return str(next(c["reason"] for c in status["conditions"] if c["type"] == "Failed"))


def test_evictions_stop_at_max_preemptions(kube: Kube) -> None:
    kube.create(
        job_body(
            "evicted",
            script=SLEEP_FOREVER,
            nodes=1,
            restartPolicy={
                "maxRestarts": 0,
                "maxPreemptions": 2,
                "backoffSeconds": 1,
                "maxBackoffSeconds": 1,
            },
        )
    )
    for attempt in (1, 2):
        kube.wait_phase("evicted", "Running", attempt=attempt)
        kube.wait_pods_running("evicted", attempt=attempt, count=1)
        _evict(kube, f"evicted-a{attempt}-n0")
    kube.wait_phase("evicted", "Running", attempt=3)
    kube.wait_pods_running("evicted", attempt=3, count=1)
    _evict(kube, "evicted-a3-n0")
    status = kube.wait_phase("evicted", "Failed")
    assert _failed_reason(status) == "MaxPreemptionsExceeded"
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert "3 preemption(s) exceed maxPreemptions=2" in failed["message"]
    assert status["restarts"] == 2
    assert status["restartsCountTowardsMax"] == 0
    assert status["lastFailure"]["reason"] == "Preempted"
    assert status["lastFailure"]["counted"] is False
    kube.wait_event("evicted", "MaxPreemptionsExceeded")


EMPTYDIR_EVICTION = 'Usage of EmptyDir volume "cairn-checkpoints" exceeds the limit "1Gi". '


def _evict_for_own_usage(kube: Kube, pod: str) -> None:
    """The status the kubelet's eviction manager writes (the agent cannot evict)."""
    status = {
        "phase": "Failed",
        "reason": "Evicted",
        "message": EMPTYDIR_EVICTION,
        "conditions": [
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "TerminationByKubelet",
                "message": EMPTYDIR_EVICTION,
            }
        ],
    }
    kube.core.patch_namespaced_pod_status(pod, kube.namespace, {"status": status})


def test_self_eviction_counts_against_max_restarts(kube: Kube) -> None:
    kube.create(
        job_body(
            "hog",
            script=SLEEP_FOREVER,
            nodes=1,
            checkpoint={"volume": {"emptyDir": {"sizeLimit": "1Gi"}}},
            restartPolicy={"maxRestarts": 1, "backoffSeconds": 1, "maxBackoffSeconds": 1},
        )
    )
    kube.wait_phase("hog", "Running", attempt=1)
    kube.wait_pods_running("hog", attempt=1, count=1)
    _evict_for_own_usage(kube, "hog-a1-n0")
    status = kube.wait_phase("hog", "Running", attempt=2)
    assert status["lastFailure"]["reason"] == "Evicted"
    assert status["lastFailure"]["counted"] is True
    assert "exceeds the limit" in status["lastFailure"]["message"]
    kube.wait_pods_running("hog", attempt=2, count=1)
    _evict_for_own_usage(kube, "hog-a2-n0")
    status = kube.wait_phase("hog", "Failed")
    assert _failed_reason(status) == "MaxRestartsExceeded"
    assert status["restartsCountTowardsMax"] == 2
    assert status["restarts"] == 1


FAIL_BY_ATTEMPT = (
    "import os, sys, time\n"
    "attempt = int(os.environ['CAIRN_ATTEMPT'])\n"
    "time.sleep(8 if attempt == 3 else 0.5)\n"
    "sys.exit(0 if attempt == 4 else 1)\n"
)
"""Attempts 1 and 2 fail at once, 3 after a healthy 8 s, 4 succeeds."""


def test_backoff_resets_after_a_healthy_attempt(kube: Kube) -> None:
    kube.create(
        job_body(
            "flaky",
            script=FAIL_BY_ATTEMPT,
            nodes=1,
            restartPolicy={
                "maxRestarts": 3,
                "backoffSeconds": 2,
                "maxBackoffSeconds": 60,
                "backoffResetSeconds": 6,
            },
        )
    )
    waits: dict[int, int] = {}

    def record(status: dict[str, Any]) -> bool:
        failure = status.get("lastFailure") or {}
        if "backoffSeconds" in failure:
            waits[failure["attempt"]] = failure["backoffSeconds"]
        return status.get("phase") in ("Succeeded", "Failed")

    status = kube.wait_status("flaky", "the end of attempt 4", record, timeout=120)
    assert status["phase"] == "Succeeded"
    assert waits == {1: 2, 2: 4, 3: 2}, "doubled after a quick failure, reset after 8 s healthy"
