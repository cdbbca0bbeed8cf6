"""How an attempt fails: gang restarts, the restart budget, exit codes, the deadline.

Covers, with real pods whose rank exits with a chosen code:
- a retryable exit of rank 1 → Restarting (restarts 1, lastFailure with rank,
  exit code, counted) → attempt 2 → the same exit again exceeds
  maxRestarts=1 → Failed with MaxRestartsExceeded; the other rank is
  stopped; Warning events RankFailed (rank and exit code) and
  MaxRestartsExceeded, and AttemptStarted for attempt 2;
- an exit code outside retryableExitCodes fails the job at once
  (NonRetryableExitCode; the message names rank and code; no attempt 2);
- activeDeadlineSeconds → Failed with DeadlineExceeded and the pods deleted.
"""

from typing import Any

import pytest

from tests.integration.operator.conftest import SLEEP_FOREVER, JobWatch, Kube, job_body

pytestmark = pytest.mark.cluster

RANK1_EXITS = """
import os, sys, time
if os.environ['CAIRN_NODE_RANK'] == '1':
    time.sleep(1)
    sys.exit({code})
time.sleep(600)
"""


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


def test_retryable_exit_restarts_then_exceeds_max_restarts(kube: Kube) -> None:
    body = job_body(
        "retry",
        script=RANK1_EXITS.format(code=3),
        restartPolicy={"maxRestarts": 1, "retryableExitCodes": [3, 137]},
    )
    created = kube.create(body)
    recorder = JobWatch(kube, "retry", resource_version=created["metadata"]["resourceVersion"])
    try:
        status = kube.wait_phase("retry", "Failed")
    finally:
        recorder.stop()

    history = recorder.statuses()
    restarting = [s for s in history if s.get("phase") == "Restarting"]
    assert restarting, [s.get("phase") for s in history]
    first = restarting[0]
    assert (first["attempt"], first["restarts"], first["restartsCountTowardsMax"]) == (1, 1, 1)
    failure = first["lastFailure"]
    assert (failure["attempt"], failure["rank"], failure["exitCode"]) == (1, 1, 3)
    assert failure["counted"] is True
    assert failure["reason"] == "RankFailed"
    assert any(s.get("phase") == "Running" and s.get("attempt") == 2 for s in history)

    assert status["attempt"] == 2
    assert status["restarts"] == 1
    assert status["restartsCountTowardsMax"] == 2
    last = status["lastFailure"]
    assert (last["attempt"], last["rank"], last["exitCode"], last["counted"]) == (2, 1, 3, True)
    failed = _condition(status, "Failed")
    assert (failed["status"], failed["reason"]) == ("True", "MaxRestartsExceeded")
    assert "maxRestarts=1" in failed["message"]
    assert status["completionTime"]

    # The surviving rank of the last attempt is stopped; nothing is started again.
    kube.wait_no_pods_running("retry")
    assert {p.metadata.labels["cairn.dev/attempt"] for p in kube.pods("retry")} <= {"1", "2"}

    kube.wait_event("retry", "MaxRestartsExceeded", contains="rank 1 exited with code 3")
    events = kube.events("retry")
    rank_failed = [e for e in events if e.reason == "RankFailed"]
    assert len(rank_failed) == 1, [(e.reason, e.message) for e in events]
    assert rank_failed[0].type == "Warning"
    assert "attempt 1: rank 1 exited with code 3" in rank_failed[0].message
    started = sorted(e.message for e in events if e.reason == "AttemptStarted")
    assert [m.split(":")[0] for m in started] == ["attempt 1", "attempt 2"]
    (final,) = [e for e in events if e.reason == "MaxRestartsExceeded"]
    assert final.type == "Warning"


def test_non_retryable_exit_fails_at_once(kube: Kube) -> None:
    body = job_body(
        "fatal",
        script=RANK1_EXITS.format(code=7),
        restartPolicy={"maxRestarts": 5, "retryableExitCodes": [3]},
    )
    kube.create(body)
    status = kube.wait_phase("fatal", "Failed")
    assert status["attempt"] == 1
    assert status["restarts"] == 0
    failed = _condition(status, "Failed")
    assert failed["reason"] == "NonRetryableExitCode"
    assert "rank 1 exited with code 7" in failed["message"]
    assert (status["lastFailure"]["rank"], status["lastFailure"]["exitCode"]) == (1, 7)
    kube.wait_no_pods_running("fatal")
    assert {p.metadata.name for p in kube.pods("fatal")} <= {"fatal-a1-n0", "fatal-a1-n1"}
    event = kube.wait_event("fatal", "NonRetryableExitCode", contains="code 7")
    assert event.type == "Warning"


def test_active_deadline_fails_and_deletes_pods(kube: Kube) -> None:
    body = job_body("late", script=SLEEP_FOREVER, activeDeadlineSeconds=3)
    kube.create(body)
    kube.wait_phase("late", "Running")
    status = kube.wait_phase("late", "Failed")
    failed = _condition(status, "Failed")
    assert failed["reason"] == "DeadlineExceeded"
    assert "activeDeadlineSeconds=3" in failed["message"]
    assert status["attempt"] == 1
    kube.wait_no_pods("late")
    event = kube.wait_event("late", "DeadlineExceeded")
    assert event.type == "Warning"
