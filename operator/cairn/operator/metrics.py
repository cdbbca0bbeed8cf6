"""Prometheus metrics of the operator, served on ``/metrics`` (``--metrics-port``).

Job metrics are computed at scrape time from the last body the operator saw
of each TrainingJob (``observe_job``/``forget_job``, fed by the job watch), so
ages are current without a timer. The checkpoint histograms are observed in
``observe_job`` once per new committed (uploaded) step, from the durations
the writer reports in the status: a job first seen with a step already
committed (an operator restart, a standby taking over) adds nothing, so no
step is counted twice. The reconcile latency histogram, the reconcile error
and S3 counters are updated where the work happens (``runtime``).

Only the leader reports jobs: a standby (``--leader-elect``, waiting for the
Lease) serves ``cairn_leader 0``, ``cairn_build_info`` and no job series, so
``sum(cairn_trainingjobs)`` over replicas is the leader's count, never a
false zero.

| metric | type | labels |
| --- | --- | --- |
| ``cairn_trainingjobs`` | gauge | ``phase`` (every phase, 0 included) |
| ``cairn_trainingjob_phase`` | gauge | ``namespace``, ``name``, ``phase`` (1, its phase only) |
| ``cairn_trainingjob_restarts`` | gauge | ``namespace``, ``name`` |
| ``cairn_trainingjob_last_commit_age_seconds`` | gauge | ``namespace``, ``name`` |
| ``cairn_trainingjob_upload_lag_steps`` | gauge | ``namespace``, ``name`` |
| ``cairn_trainingjob_upload_lag_seconds`` | gauge | ``namespace``, ``name`` |
| ``cairn_trainingjob_verified_step`` | gauge | ``namespace``, ``name`` |
| ``cairn_checkpoint_write_seconds`` | histogram | ``namespace`` |
| ``cairn_checkpoint_stall_seconds`` | histogram | ``namespace`` |
| ``cairn_checkpoint_upload_seconds`` | histogram | ``namespace`` |
| ``cairn_reconcile_duration_seconds`` | histogram | |
| ``cairn_reconcile_errors_total`` | counter | ``kind`` (``api``, ``transport``, ``exception``) |
| ``cairn_leader`` | gauge | (1: this replica acts, 0: standby) |
| ``cairn_build_info`` | gauge | ``version``, ``python`` (always 1) |
| ``cairn_storage_pass_duration_seconds`` | histogram | |
| ``cairn_retention_deleted_steps_total`` | counter | |
| ``cairn_storage_errors_total`` | counter | |
"""

import dataclasses
import datetime
import importlib.metadata
import logging
import math
import platform
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import prometheus_client
from prometheus_client import core, registry

from cairn.api import jobstatus
from cairn.operator.core import jobobserve

LOG = logging.getLogger(__name__)
DISTRIBUTION = "cairn-training"
"""Whose version ``cairn_build_info`` reports."""
DEFAULT_PORT = 9090
"""The chart's ``metrics.port`` (passed as ``CAIRN_METRICS_PORT``)."""

# No `*_created` series: Prometheus does not use them, and each labelled
# histogram child would add one.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
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
RECONCILE_ERRORS = prometheus_client.Counter(
    "cairn_reconcile_errors",
    "Reconciles that failed: kind=api (an API call was refused), transport (no answer), "
    "exception (a bug).",
    labelnames=["kind"],
)
for _kind in ("api", "transport", "exception"):
    RECONCILE_ERRORS.labels(kind=_kind)  # all series exist from the start: rate() sees the first
_CHECKPOINT_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
CHECKPOINT_WRITE_SECONDS = prometheus_client.Histogram(
    "cairn_checkpoint_write_seconds",
    "Background write time of each committed checkpoint step (lastCommitted.writeSeconds).",
    labelnames=["namespace"],
    buckets=_CHECKPOINT_BUCKETS,
)
CHECKPOINT_STALL_SECONDS = prometheus_client.Histogram(
    "cairn_checkpoint_stall_seconds",
    "Time training was blocked by each committed save (lastCommitted.stallSeconds).",
    labelnames=["namespace"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)
CHECKPOINT_UPLOAD_SECONDS = prometheus_client.Histogram(
    "cairn_checkpoint_upload_seconds",
    "Seconds from a step's commit to its upload to S3 (queueing included).",
    labelnames=["namespace"],
    buckets=_CHECKPOINT_BUCKETS,
)
_HISTOGRAMS = {
    "write": CHECKPOINT_WRITE_SECONDS,
    "stall": CHECKPOINT_STALL_SECONDS,
    "upload": CHECKPOINT_UPLOAD_SECONDS,
}
_REMEMBERED_COMMITS = 16
"""Commit times kept per job to time uploads: more than any upload backlog worth timing."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JobFacts:
    """What the metrics need of one job (from its status)."""

    phase: str | None
    restarts: int
    committed_step: int | None
    committed_time: datetime.datetime | None
    write_seconds: float | None = None
    stall_seconds: float | None = None
    uploaded_step: int | None
    uploaded_time: datetime.datetime | None
    verified_step: int | None


def facts(body: Mapping[str, Any]) -> JobFacts:
    """The metric inputs of a TrainingJob body. Pure; tolerant of a malformed status."""
    status = jobobserve.parse_status(body)
    ckpts = status.checkpoints or jobstatus.CheckpointsStatus()
    committed, uploaded = ckpts.last_committed, ckpts.last_uploaded
    return JobFacts(
        phase=status.phase,
        restarts=status.restarts or 0,
        committed_step=committed.step if committed else None,
        committed_time=committed.time if committed else None,
        write_seconds=committed.write_seconds if committed else None,
        stall_seconds=committed.stall_seconds if committed else None,
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


def _changed(step: int | None, time: datetime.datetime | None, before: tuple[Any, Any]) -> bool:
    return step is not None and (step, time) != before


def _duration(seconds: float | None) -> list[float]:
    """A reported duration worth observing: finite and not negative (status is untrusted)."""
    return [seconds] if seconds is not None and math.isfinite(seconds) and seconds >= 0 else []


def checkpoint_samples(
    *,
    before: JobFacts | None,
    after: JobFacts,
    commit_times: Mapping[int, datetime.datetime],
) -> list[tuple[str, float]]:
    """The (histogram, seconds) samples one status change adds. Pure.

    A new commit (step or time changed: a step re-written after a restart
    counts again) gives its write and stall seconds; a new upload gives the
    seconds since that step's commit, if its commit was seen. Nothing on a
    job's first sight: its current steps may have been counted by the
    replica that ran before this one.
    """
    if before is None:
        return []
    samples: list[tuple[str, float]] = []
    if _changed(
        after.committed_step, after.committed_time, (before.committed_step, before.committed_time)
    ):
        samples += [("write", value) for value in _duration(after.write_seconds)]
        samples += [("stall", value) for value in _duration(after.stall_seconds)]
    uploaded = (before.uploaded_step, before.uploaded_time)
    if _changed(after.uploaded_step, after.uploaded_time, uploaded) and after.uploaded_time:
        committed = commit_times.get(after.uploaded_step or 0)
        if committed is not None:
            seconds = (after.uploaded_time - committed).total_seconds()
            samples += [("upload", value) for value in _duration(max(0.0, seconds))]
    return samples


class JobCollector(registry.Collector):
    """Per-job gauges computed at scrape time; none while this replica stands by."""

    def __init__(self, clock: Callable[[], datetime.datetime]) -> None:
        self._jobs: dict[tuple[str, str], JobFacts] = {}
        self._commit_times: dict[tuple[str, str], dict[int, datetime.datetime]] = {}
        self._lock = threading.Lock()
        self._clock = clock
        self.leading = True
        """False on a standby: it reports no job series (not zeros)."""

    def observe(self, namespace: str, name: str, body: Mapping[str, Any]) -> None:
        """Record the job's latest body; observe the checkpoint histograms for new steps."""
        job = facts(body)
        key = (namespace, name)
        with self._lock:
            before = self._jobs.get(key)
            self._jobs[key] = job
            times = self._commit_times.setdefault(key, {})
            if job.committed_step is not None and job.committed_time is not None:
                times[job.committed_step] = job.committed_time
                for old in sorted(times)[:-_REMEMBERED_COMMITS]:
                    del times[old]
            samples = checkpoint_samples(before=before, after=job, commit_times=times)
        for histogram, seconds in samples:
            _HISTOGRAMS[histogram].labels(namespace=namespace).observe(seconds)

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._jobs.pop((namespace, name), None)
            self._commit_times.pop((namespace, name), None)

    def collect(self) -> Iterator[core.Metric]:
        if not self.leading:
            return
        with self._lock:
            jobs = dict(self._jobs)
        now = self._clock()
        labels = ["namespace", "name"]
        phases = core.GaugeMetricFamily(
            "cairn_trainingjobs", "TrainingJobs by phase.", labels=["phase"]
        )
        counts = dict.fromkeys(jobstatus.PHASES, 0)
        job_phase = core.GaugeMetricFamily(
            "cairn_trainingjob_phase",
            "1 for the job's current phase (alerts join on it).",
            labels=[*labels, "phase"],
        )
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
                job_phase.add_metric([*key, job.phase], 1)
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
        yield from (phases, job_phase, restarts, age, lag_steps, lag_seconds, verified)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


JOBS = JobCollector(_now)
prometheus_client.REGISTRY.register(JOBS)
LEADER = prometheus_client.Gauge(
    "cairn_leader", "1: this replica runs the operator; 0: a standby waiting for the Lease."
)
LEADER.set(1)
BUILD_INFO = prometheus_client.Gauge(
    "cairn_build_info", "The operator's version (always 1).", labelnames=["version", "python"]
)


def _version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


BUILD_INFO.labels(version=_version(), python=platform.python_version()).set(1)


def set_leading(leading: bool) -> None:
    """Mark this replica leader or standby (``__main__``, around the Lease election)."""
    JOBS.leading = leading
    LEADER.set(1 if leading else 0)


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
