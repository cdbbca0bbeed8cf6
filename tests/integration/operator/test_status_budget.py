"""A running job's status is written within its budget, against the real API server.

Covers: a rank 0 that moves its step every 0.05 s (a stand-in writer: the
trainer's own `runtime_config` and `StatusReporter`, fed from the pod
environment the operator built) changes its job's status at most
window/statusIntervalSeconds + 1 times over a one-minute window by default,
and the operator adds no status write of its own to an idle running job; a
job with a small `statusIntervalSeconds` gets many more writes over the
same window (the field reaches the writer through the pod env).

Every write that changes an object is one watch event, so the events of one
job's watch from a known resourceVersion that change its status count the
status writes that reached etcd.
"""

import time
from typing import Any

from tests.integration.operator.conftest import JobWatch, Kube, job_body

WINDOW_SECONDS = 60.0
FAST_INTERVAL = 2

STAND_IN_WRITER = """
import time
from kubernetes import client, config
from cairn.checkpoint import runtime_config, status_reporter

cfg = runtime_config.from_env()
config.load_incluster_config()
reporter = status_reporter.StatusReporter(
    patch=status_reporter.kubernetes_patcher(
        api_client=client.ApiClient(), namespace=cfg.namespace, name=cfg.job_name
    ),
    status_interval_seconds=cfg.status_interval_seconds,
)
step = 0
while True:
    step += 1
    reporter.update(step=step, checkpoints=None)
    time.sleep(0.05)
"""


def _status_writes(watch: JobWatch, start: dict[str, Any]) -> list[str]:
    """One line per watch event that changed the status: the step and the
    status fields that changed (for the failure message)."""
    writes = []
    before = start
    for status in watch.statuses():
        if status != before:
            changed = sorted(k for k in set(before) | set(status) if before.get(k) != status.get(k))
            writes.append(f"step={status.get('step')} changed={changed}")
        before = status
    return writes


def _wait_step(kube: Kube, name: str) -> None:
    kube.wait_status(name, "a step reported", lambda status: status.get("step") is not None)


def test_running_job_status_writes_stay_within_the_budget(kube: Kube) -> None:
    default = job_body("budget-default", script=STAND_IN_WRITER, nodes=1)
    fast = job_body(
        "budget-fast",
        script=STAND_IN_WRITER,
        nodes=1,
        checkpoint={"statusIntervalSeconds": FAST_INTERVAL},
    )
    kube.create(default)
    kube.create(fast)
    for name in ("budget-default", "budget-fast"):
        kube.wait_phase(name, "Running")
        _wait_step(kube, name)
    start = {name: kube.job(name) for name in ("budget-default", "budget-fast")}
    watches = {
        name: JobWatch(kube, name, resource_version=job["metadata"]["resourceVersion"])
        for name, job in start.items()
    }
    time.sleep(WINDOW_SECONDS)  # the window the writes are counted over
    for watch in watches.values():
        watch.stop()
    default_writes = _status_writes(watches["budget-default"], start["budget-default"]["status"])
    fast_writes = _status_writes(watches["budget-fast"], start["budget-fast"]["status"])
    # Default 30 s: two step reports a minute (one more where the window straddles
    # three), and no write from the operator.
    assert 1 <= len(default_writes) <= WINDOW_SECONDS / 30 + 1, default_writes
    # The same writer with a 2 s interval: the budget is the field, not the writer's pace.
    assert len(fast_writes) >= WINDOW_SECONDS / FAST_INTERVAL / 2, fast_writes
    assert all(s.get("phase") == "Running" for s in watches["budget-default"].statuses())
