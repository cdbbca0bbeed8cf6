"""Plan from the truth: a pod deleted while the operator's watch was cut does not wedge the job.

Covers: the shared operator process is paused (SIGSTOP, its pid from the
devcluster's operator pidfile). While it sleeps:
1. a burst of large pod updates overflows what the API server buffers for the
   paused watcher, and the server drops its pod watch ("Forcing pods watcher
   close due to unresponsiveness", as for any slow client);
2. the job's running pod is deleted: no DELETED event is queued for it;
3. after the watch cache's history window (75 s of freshness in 1.34) a second
   burst pushes the operator's last resourceVersion out of that history.
Resumed (SIGCONT), the operator's pod reflector (``podcache``) either reads
the DELETED event the server still had for its watch, or re-watches from its
old resourceVersion, gets 410 Gone and re-lists (``test_pod_reflector``
covers that path on its own): either way the cache drops the pod, the job is
kicked, and the gang restarts: attempt 2 runs. (kopf's own pod index, used
before, kept such a pod as a Running ghost until a per-job list found it.)
The operator is resumed whatever happens (finally).
"""

import os
import signal
import time

import pytest
from kubernetes import client

from cairn.devcluster import processes
from tests import demo
from tests.integration.devcluster import kube_helpers as kh
from tests.integration.operator.conftest import SLEEP_FOREVER, Kube, job_body

pytestmark = pytest.mark.cluster

CUT_BURST = 120
"""Pod updates of ~200 KB each: well over what the server buffers for a watcher."""
HISTORY_BURST = 600
"""Small pod updates after the window: more than the watch cache keeps."""
HISTORY_WINDOW_SECONDS = 80.0
"""The watch cache only grows while its oldest event is younger than 75 s."""
RESYNC_BOUND = 150.0
"""The loop resyncs at least every 60 s; twice that plus a restart."""


def _operator(kube: Kube) -> processes.Tracked:
    tracked = processes.read_pidfile(kube.handle.target.state.pidfile(demo.OPERATOR))
    assert tracked is not None and processes.is_alive(tracked), "the shared operator is not up"
    return tracked


def _filler(kube: Kube) -> None:
    """A pod nobody runs (a scheduling gate keeps it unbound) to update in bursts."""
    pod = client.V1Pod(
        metadata=client.V1ObjectMeta(name="filler"),
        spec=client.V1PodSpec(
            scheduling_gates=[client.V1PodSchedulingGate(name="cairn.dev/never")],
            containers=[client.V1Container(name="c", image="none", command=["true"])],
        ),
    )
    kube.core.create_namespaced_pod(kube.namespace, pod)


def _burst(kube: Kube, *, count: int, size: int) -> None:
    for i in range(count):
        blob = f"{i:06d}" + "x" * size
        kube.core.patch_namespaced_pod(
            "filler", kube.namespace, {"metadata": {"annotations": {"cairn.dev/filler": blob}}}
        )


def test_pod_deleted_while_watch_cut_does_not_wedge(kube: Kube) -> None:
    kube.create(job_body("cut", script=SLEEP_FOREVER, nodes=1, restartPolicy={"backoffSeconds": 1}))
    kube.wait_phase("cut", "Running", attempt=1)
    kube.wait_pods_running("cut", attempt=1, count=1)
    _filler(kube)
    pid = _operator(kube).pid
    os.kill(pid, signal.SIGSTOP)
    try:
        _burst(kube, count=CUT_BURST, size=200_000)
        kube.core.delete_namespaced_pod("cut-a1-n0", kube.namespace, grace_period_seconds=0)
        kh.wait_for(
            lambda: not kube.pods("cut", attempt=1), timeout=60, what="cut-a1-n0 gone from the API"
        )
        time.sleep(HISTORY_WINDOW_SECONDS)
        _burst(kube, count=HISTORY_BURST, size=10)
    finally:
        os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic()
    status = kube.wait_phase("cut", "Running", attempt=2, timeout=RESYNC_BOUND)
    print(f"MEASURE cut-watch-recovery {time.monotonic() - resumed:.1f}")
    assert status["lastFailure"]["reason"] == "Preempted"
    assert status["lastFailure"]["counted"] is False
    kube.wait_pods_running("cut", attempt=2, count=1)
