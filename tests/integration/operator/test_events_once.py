"""Every transition is decided and announced once, also under a burst of jobs.

Covers: 12 jobs created suspended and 6 created running at once, then the
running ones suspended: each suspended-at-creation job gets exactly one
Suspended event, each other job exactly one AttemptStarted, Running,
Suspending and Suspended, and every job ends with observedGeneration equal
to its generation. (Before the fix in reconcile.Written, kopf's own
finalizer/annotation patches landing between a status patch and the watch
catching up made the operator plan from a stale copy and announce
Suspended/Suspending twice, in every run of this burst.)
"""

import collections

import pytest

from tests.integration.operator.conftest import SLEEP_FOREVER, Kube, job_body

pytestmark = pytest.mark.cluster

SUSPENDED = 12
RUNNING = 6


def test_transitions_announced_once(kube: Kube) -> None:
    for i in range(SUSPENDED):
        kube.create(job_body(f"s{i}", script=SLEEP_FOREVER, nodes=1, suspend=True))
    for i in range(RUNNING):
        kube.create(job_body(f"r{i}", script=SLEEP_FOREVER, nodes=1))
    for i in range(RUNNING):
        kube.wait_phase(f"r{i}", "Running")
        kube.patch_spec(f"r{i}", {"suspend": True})
    for i in range(RUNNING):
        kube.wait_phase(f"r{i}", "Suspended")
    for i in range(SUSPENDED):
        kube.wait_phase(f"s{i}", "Suspended")
    for i in range(RUNNING):
        kube.wait_event(f"r{i}", "Suspended")

    for name in [f"s{i}" for i in range(SUSPENDED)] + [f"r{i}" for i in range(RUNNING)]:
        job = kube.job(name)
        assert job["status"]["observedGeneration"] == job["metadata"]["generation"], name
    seen = collections.Counter(
        (e.involved_object.name, e.reason)
        for e in kube.core.list_namespaced_event(
            kube.namespace, field_selector="involvedObject.kind=TrainingJob"
        ).items
    )
    expected = collections.Counter({(f"s{i}", "Suspended"): 1 for i in range(SUSPENDED)})
    for i in range(RUNNING):
        for reason in ("AttemptStarted", "Running", "Suspending", "Suspended"):
            expected[(f"r{i}", reason)] = 1
    assert seen == expected
