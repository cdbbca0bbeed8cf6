"""metrics: checkpoint histograms once per new step, the standby's silence, build info.

Covers: a job's first sight observes nothing (its steps may be counted by the
replica before); a new commit observes its write and stall seconds once (the
same status seen again adds nothing); the same step re-committed after a
restart (a new time) counts again; an upload observes the seconds since that
step's commit, not when its commit was never seen; untrusted durations
(negative, infinite) are dropped; a standby collects no job series at all
(not zeros) and says ``cairn_leader 0``; ``cairn_build_info`` and both
``cairn_reconcile_errors_total`` series exist from the start.
"""

import datetime
import uuid

import prometheus_client
import pytest

from cairn.operator import metrics

NOW = datetime.datetime(2026, 11, 23, 3, 0, tzinfo=datetime.UTC)


def job(
    *,
    committed: int | None = None,
    time: str = "2026-11-23T02:59:00Z",
    write: float | None = 2.0,
    stall: float | None = 0.25,
    uploaded: int | None = None,
    uploaded_time: str = "2026-11-23T02:59:30Z",
) -> dict[str, object]:
    checkpoints: dict[str, object] = {}
    if committed is not None:
        checkpoints["lastCommitted"] = {
            "step": committed,
            "time": time,
            "writeSeconds": write,
            "stallSeconds": stall,
        }
    if uploaded is not None:
        checkpoints["lastUploaded"] = {"step": uploaded, "time": uploaded_time}
    return {"status": {"phase": "Running", "checkpoints": checkpoints}}


def counts(namespace: str) -> dict[str, tuple[float | None, float | None]]:
    """(count, sum) of each checkpoint histogram for ``namespace``."""
    get = prometheus_client.REGISTRY.get_sample_value
    labels = {"namespace": namespace}
    return {
        kind: (
            get(f"cairn_checkpoint_{kind}_seconds_count", labels),
            get(f"cairn_checkpoint_{kind}_seconds_sum", labels),
        )
        for kind in ("write", "stall", "upload")
    }


@pytest.fixture
def namespace() -> str:
    return f"ns-{uuid.uuid4().hex[:8]}"


def test_first_sight_observes_nothing(namespace: str) -> None:
    jobs = metrics.JobCollector(lambda: NOW)
    jobs.observe(namespace, "a", job(committed=30, uploaded=30))
    assert counts(namespace) == {k: (None, None) for k in ("write", "stall", "upload")}


def test_new_commit_observed_once(namespace: str) -> None:
    jobs = metrics.JobCollector(lambda: NOW)
    jobs.observe(namespace, "a", job())
    jobs.observe(namespace, "a", job(committed=5, write=3.0, stall=0.5))
    jobs.observe(namespace, "a", job(committed=5, write=3.0, stall=0.5))  # a resync
    got = counts(namespace)
    assert got["write"] == (1, 3.0)
    assert got["stall"] == (1, 0.5)
    assert got["upload"] == (None, None)


def test_recommitted_step_counts_again(namespace: str) -> None:
    jobs = metrics.JobCollector(lambda: NOW)
    jobs.observe(namespace, "a", job())
    jobs.observe(namespace, "a", job(committed=10))
    jobs.observe(namespace, "a", job(committed=10, time="2026-11-23T02:59:40Z"))
    assert counts(namespace)["write"] == (2, 4.0)


def test_upload_seconds_since_its_commit(namespace: str) -> None:
    jobs = metrics.JobCollector(lambda: NOW)
    jobs.observe(namespace, "a", job())
    jobs.observe(namespace, "a", job(committed=5, time="2026-11-23T02:59:00Z"))
    jobs.observe(namespace, "a", job(committed=10, time="2026-11-23T02:59:20Z"))
    jobs.observe(namespace, "a", job(committed=10, time="2026-11-23T02:59:20Z", uploaded=5))
    assert counts(namespace)["upload"] == (1, 30.0)


def test_upload_of_an_unseen_commit_is_not_timed(namespace: str) -> None:
    jobs = metrics.JobCollector(lambda: NOW)
    jobs.observe(namespace, "a", job())
    jobs.observe(namespace, "a", job(uploaded=5))
    assert counts(namespace)["upload"] == (None, None)


@pytest.mark.parametrize("bad", [-1.0, float("inf")])
def test_untrusted_durations_dropped(namespace: str, bad: float) -> None:
    jobs = metrics.JobCollector(lambda: NOW)
    jobs.observe(namespace, "a", job())
    jobs.observe(namespace, "a", job(committed=5, write=bad, stall=bad))
    got = counts(namespace)
    assert got["write"] == (None, None)
    assert got["stall"] == (None, None)


def test_standby_reports_no_job_series(monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = metrics.JobCollector(lambda: NOW)
    jobs.observe("ns", "a", job(committed=5))
    jobs.leading = False
    registry = prometheus_client.CollectorRegistry()
    registry.register(jobs)
    assert [family.name for family in registry.collect()] == []
    monkeypatch.setattr(metrics.JOBS, "leading", True)
    metrics.set_leading(False)
    assert prometheus_client.REGISTRY.get_sample_value("cairn_leader") == 0
    assert "cairn_trainingjobs{" not in prometheus_client.generate_latest().decode()
    metrics.set_leading(True)
    assert prometheus_client.REGISTRY.get_sample_value("cairn_leader") == 1


def test_build_info_and_error_series_exist() -> None:
    text = prometheus_client.generate_latest().decode()
    assert 'cairn_build_info{python="' in text
    assert 'cairn_reconcile_errors_total{kind="api"} 0.0' in text
    assert 'cairn_reconcile_errors_total{kind="exception"} 0.0' in text
    # Exists from the start; its value is process-wide (test_reconcile_backoff counts some).
    assert 'cairn_reconcile_errors_total{kind="transport"} ' in text
