"""metrics: the job gauges computed at scrape time, and the reconcile histogram.

Covers: jobs by phase (every phase present, zeros included), restarts,
last-commit age, upload lag in steps and seconds (0 when the newest commit
is uploaded), the operator's verified step, a job forgotten on deletion, and
the `--metrics-port` default from `CAIRN_METRICS_PORT` (the chart's value).
"""

import datetime

import prometheus_client
import pytest

from cairn.operator import __main__ as entry
from cairn.operator import metrics

NOW = datetime.datetime(2026, 11, 23, 3, 0, tzinfo=datetime.UTC)


def body(**status: object) -> dict[str, object]:
    return {"status": status}


def scrape(collector: metrics.JobCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = prometheus_client.CollectorRegistry()
    registry.register(collector)
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in registry.collect()
        for sample in family.samples
    }


def test_job_gauges() -> None:
    jobs = metrics.JobCollector(lambda: NOW)
    jobs.observe(
        "ns",
        "a",
        body(
            phase="Running",
            restarts=2,
            checkpoints={
                "lastCommitted": {"step": 50, "time": "2026-11-23T02:59:00Z"},
                "lastUploaded": {"step": 40, "time": "2026-11-23T02:58:00Z"},
            },
            storage={"verifiedStep": 40},
        ),
    )
    jobs.observe(
        "ns",
        "b",
        body(
            phase="Running",
            checkpoints={
                "lastCommitted": {"step": 10, "time": "2026-11-23T02:50:00Z"},
                "lastUploaded": {"step": 10},
            },
        ),
    )
    jobs.observe("ns", "c", body(phase="Failed"))
    jobs.observe("ns", "gone", body(phase="Succeeded"))
    jobs.forget("ns", "gone")
    got = scrape(jobs)
    a = (("name", "a"), ("namespace", "ns"))
    b = (("name", "b"), ("namespace", "ns"))
    assert got[("cairn_trainingjobs", (("phase", "Running"),))] == 2
    assert got[("cairn_trainingjobs", (("phase", "Failed"),))] == 1
    assert got[("cairn_trainingjobs", (("phase", "Succeeded"),))] == 0
    assert got[("cairn_trainingjob_restarts", a)] == 2
    assert got[("cairn_trainingjob_last_commit_age_seconds", a)] == 60
    assert got[("cairn_trainingjob_last_commit_age_seconds", b)] == 600
    assert got[("cairn_trainingjob_upload_lag_steps", a)] == 10
    assert got[("cairn_trainingjob_upload_lag_seconds", a)] == 60
    assert got[("cairn_trainingjob_upload_lag_steps", b)] == 0
    assert got[("cairn_trainingjob_upload_lag_seconds", b)] == 0
    assert got[("cairn_trainingjob_verified_step", a)] == 40
    assert ("cairn_trainingjob_verified_step", b) not in got
    assert not any(dict(labels).get("name") == "gone" for _, labels in got)


def test_reconcile_histogram_is_registered() -> None:
    metrics.RECONCILE_SECONDS.observe(0.02)
    text = prometheus_client.generate_latest().decode()
    assert "cairn_reconcile_duration_seconds_bucket" in text
    assert "cairn_trainingjobs{" in text


@pytest.mark.parametrize(("env", "port"), [(None, 9090), ("9191", 9191), ("x", 9090)])
def test_metrics_port_default(monkeypatch: pytest.MonkeyPatch, env: str | None, port: int) -> None:
    if env is None:
        monkeypatch.delenv("CAIRN_METRICS_PORT", raising=False)
    else:
        monkeypatch.setenv("CAIRN_METRICS_PORT", env)
    assert entry._default_metrics_port() == port
