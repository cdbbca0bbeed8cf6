"""Finished jobs have no reconcile daemon and are still acted on (issue 11).

Once a job is Succeeded or Failed, kopf stops its reconcile daemon (the
``when=`` filter turns false); what is left to do is one reconcile from the
operator's shared task whenever the job or one of its pods changes. Covers,
with the shared operator and real pods: a job that succeeded keeps its pods
(``finishedPods: Keep``) and announces ``Succeeded`` exactly once (the
stopping daemon and the shared task do not both announce it); changing its
``cleanup.finishedPods`` to ``Delete`` afterwards deletes the pods (a spec
change of a finished job is still acted on); a job that failed for a
non-retryable exit code has its other, still running rank stopped.
"""

import pytest

from tests.integration.operator.conftest import Kube, job_body

pytestmark = pytest.mark.cluster

QUICK = "import time; time.sleep(0.5)"
RANK0_FAILS = (
    "import os, time\nif os.environ['CAIRN_NODE_RANK'] == '0': raise SystemExit(3)\ntime.sleep(600)"
)


def test_finished_job_is_still_acted_on(kube: Kube) -> None:
    kube.create(job_body("done", script=QUICK))
    kube.wait_phase("done", "Succeeded")
    pods = kube.pods("done")
    assert {p.status.phase for p in pods} == {"Succeeded"} and len(pods) == 2

    kube.patch_spec("done", {"cleanup": {"finishedPods": "Delete"}})
    kube.wait_no_pods("done")
    announced = [e for e in kube.events("done") if e.reason == "Succeeded"]
    assert len(announced) == 1, [e.message for e in announced]


def test_failed_job_stops_its_other_rank(kube: Kube) -> None:
    kube.create(job_body("broken", script=RANK0_FAILS, restartPolicy={"retryableExitCodes": [1]}))
    status = kube.wait_phase("broken", "Failed")
    assert status["lastFailure"]["exitCode"] == 3
    kube.wait_no_pods_running("broken")
