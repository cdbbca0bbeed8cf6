"""Prometheus metrics of the operator, served on ``/metrics`` (``--metrics-port``).

Job metrics are computed at scrape time from the last body the operator saw
of each TrainingJob (``observe_job``/``forget_job``, fed by the job watch), so
ages are current without a timer. The reconcile latency histogram and the S3
counters are updated where the work happens (``handlers``).

| metric | type | labels |
| --- | --- | --- |
| ``cairn_trainingjobs`` | gauge | ``phase`` (every phase, 0 included) |
| ``cairn_trainingjob_restarts`` | gauge | ``namespace``, ``name`` |
| ``cairn_trainingjob_last_commit_age_seconds`` | gauge | ``namespace``, ``name`` |
| ``cairn_trainingjob_upload_lag_steps`` | gauge | ``namespace``, ``name`` |
| ``cairn_trainingjob_upload_lag_seconds`` | gauge | ``namespace``, ``name`` |
| ``cairn_trainingjob_verified_step`` | gauge | ``namespace``, ``name`` |
| ``cairn_reconcile_duration_seconds`` | histogram | |
| ``cairn_storage_pass_duration_seconds`` | histogram | |
| ``cairn_retention_deleted_steps_total`` | counter | |
| ``cairn_storage_errors_total`` | counter | |
"""

import dataclasses
import datetime
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import prometheus_client
from prometheus_client import core, registry

from cairn.api import jobstatus
from cairn.operator import observe

LOG = logging.getLogger(__name__)
DEFAULT_PORT = 9090
"""The chart's ``metrics.port`` (passed as ``CAIRN_METRICS_PORT``)."""

RECONCILE_SECONDS = prometheus_client.Histogram(
    "cairn_reconcile_duration_seconds",
    "Duration of one observe -> plan -> apply reconcile of a TrainingJob.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
STORAGE_PASS_SECONDS = prometheus_client.Histogram(
    "cairn_storage_pass_duration_seconds",
    "Duration of one S3 verification and retention pass of a TrainingJob.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
RETENTION_DELETED = prometheus_client.Counter(
    "cairn_retention_deleted_steps",
    "Checkpoint steps deleted from S3 by remote retention.",
)
STORAGE_ERRORS = prometheus_client.Counter(
    "cairn_storage_errors",
    "S3 passes that failed (listing, reading, deleting or the credentials).",
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JobFacts:
    """What the metrics need of one job (from its status)."""

    phase: str | None
    restarts: int
    committed_step: int | None
    committed_time: datetime.datetime | None
    uploaded_step: int | None
    uploaded_time: datetime.datetime | None
    verified_step: int | None


def facts(body: Mapping[str, Any]) -> JobFacts:
    """The metric inputs of a TrainingJob body. Pure; tolerant of a malformed status."""
    status = observe.parse_status(body)
    ckpts = status.checkpoints or jobstatus.CheckpointsStatus()
    committed, uploaded = ckpts.last_committed, ckpts.last_uploaded
    return JobFacts(
        phase=status.phase,
        restarts=status.restarts or 0,
        committed_step=committed.step if committed else None,
        committed_time=committed.time if committed else None,
        uploaded_step=uploaded.step if uploaded else None,
        uploaded_time=uploaded.time if uploaded else None,
        verified_step=status.storage.verified_step if status.storage else None,
    )


def upload_lag(job: JobFacts, now: datetime.datetime) -> tuple[float, float] | None:
    """(steps, seconds) the newest commit waits for its upload; None without a commit. Pure.

    Seconds: time since the newest commit while it is not uploaded, else 0.
    """
    if job.committed_step is None:
        return None
    uploaded = job.uploaded_step if job.uploaded_step is not None else -1
    if uploaded >= job.committed_step:
        return 0.0, 0.0
    steps = float(job.committed_step - max(uploaded, 0))
    seconds = max(0.0, (now - job.committed_time).total_seconds()) if job.committed_time else 0.0
    return steps, seconds


class JobCollector(registry.Collector):
    """Per-job gauges computed at scrape time."""

    def __init__(self, clock: Callable[[], datetime.datetime]) -> None:
        self._jobs: dict[tuple[str, str], JobFacts] = {}
        self._lock = threading.Lock()
        self._clock = clock

    def observe(self, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        job = facts(body)
        with self._lock:
            self._jobs[(namespace, name)] = job

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._jobs.pop((namespace, name), None)

    def collect(self) -> Iterator[core.Metric]:
        with self._lock:
            jobs = dict(self._jobs)
        now = self._clock()
        labels = ["namespace", "name"]
        phases = core.GaugeMetricFamily(
            "cairn_trainingjobs", "TrainingJobs by phase.", labels=["phase"]
        )
        counts = dict.fromkeys(jobstatus.PHASES, 0)
        restarts = core.GaugeMetricFamily(
            "cairn_trainingjob_restarts", "Restarts of the job (status.restarts).", labels=labels
        )
        age = core.GaugeMetricFamily(
            "cairn_trainingjob_last_commit_age_seconds",
            "Seconds since the job's last committed checkpoint.",
            labels=labels,
        )
        lag_steps = core.GaugeMetricFamily(
            "cairn_trainingjob_upload_lag_steps",
            "Last committed step minus last uploaded step.",
            labels=labels,
        )
        lag_seconds = core.GaugeMetricFamily(
            "cairn_trainingjob_upload_lag_seconds",
            "Seconds the newest committed step has waited for its upload (0 when uploaded).",
            labels=labels,
        )
        verified = core.GaugeMetricFamily(
            "cairn_trainingjob_verified_step",
            "Newest step the operator verified in S3.",
            labels=labels,
        )
        for (namespace, name), job in sorted(jobs.items()):
            key = [namespace, name]
            if job.phase in counts:
                counts[job.phase] += 1
            restarts.add_metric(key, job.restarts)
            if job.committed_time is not None:
                age.add_metric(key, max(0.0, (now - job.committed_time).total_seconds()))
            lag = upload_lag(job, now)
            if lag is not None and job.uploaded_step is not None:
                lag_steps.add_metric(key, lag[0])
                lag_seconds.add_metric(key, lag[1])
            if job.verified_step is not None:
                verified.add_metric(key, job.verified_step)
        for phase, count in counts.items():
            phases.add_metric([phase], count)
        yield from (phases, restarts, age, lag_steps, lag_seconds, verified)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


JOBS = JobCollector(_now)
prometheus_client.REGISTRY.register(JOBS)


def serve(port: int, addr: str = "0.0.0.0") -> bool:
    """Serve ``/metrics`` in a background thread; False (logged) if the port is taken."""
    if port <= 0:
        return False
    try:
        prometheus_client.start_http_server(port, addr=addr)
    except OSError as error:
        LOG.error("metrics endpoint on port %d not started: %s", port, error)
        return False
    return True
