"""The happy path: every rank exits 0 → Succeeded.

Covers: a 2-node job whose ranks exit 0 reaches Succeeded in attempt 1 with
completionTime, Complete=True and Ready=False, an event Succeeded, no
restarts, and its finished pods kept (cleanup.finishedPods defaults to Keep)
in phase Succeeded; with `finishedPods: Delete` they are deleted.
"""

import pytest

from tests.integration.operator.conftest import Kube, job_body

pytestmark = pytest.mark.cluster

QUICK = "import time; time.sleep(0.5)"


def test_all_ranks_exit_zero(kube: Kube) -> None:
    kube.create(job_body("ok", script=QUICK))
    kube.create(job_body("tidy", script=QUICK, cleanup={"finishedPods": "Delete"}))
    status = kube.wait_phase("ok", "Succeeded")
    assert (status["attempt"], status["restarts"]) == (1, 0)
    assert status["completionTime"]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert (conditions["Complete"]["status"], conditions["Complete"]["reason"]) == (
        "True",
        "Succeeded",
    )
    assert conditions["Ready"]["status"] == "False"
    assert conditions["Failed"]["status"] == "False"
    assert conditions["Reconciling"]["status"] == "False"
    event = kube.wait_event("ok", "Succeeded", contains="attempt 1")
    assert event.type == "Normal"
    pods = kube.pods("ok")
    assert [p.metadata.name for p in pods] == ["ok-a1-n0", "ok-a1-n1"]
    assert {p.status.phase for p in pods} == {"Succeeded"}

    kube.wait_phase("tidy", "Succeeded")
    kube.wait_no_pods("tidy")
