"""Rank 0's status feed and API fence, started by `CheckpointManager` on its own.

Under the operator the pod's environment names the job and asks rank 0 to
report (`CAIRN_REPORT_STATUS=1`, `CAIRN_JOB_NAME`, `CAIRN_NAMESPACE`,
`cairn.api.podenv`). Then the manager of rank 0 starts one `StatusFeed`:
it folds the writer's progress events (`checkpoint_status`, pure), the
training step the manager learns from `save(step)` / `should_save(step)` /
`restore()` (or `CheckpointManager.report_step`) and the resume into
`status.step` and `status.checkpoints`, delivered by `status_reporter`; and
it builds the authoritative `fence.ApiFence` the commit checks. Without that
environment (a laptop, a test, a non-zero rank) there is no feed, no error,
no API call. With the environment but no in-cluster credentials it logs why
and stays silent: training never depends on the feed.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import threading
import typing
from collections.abc import Mapping

from cairn.api import jobstatus, podenv
from cairn.checkpoint import (
    checkpoint_status,
    events,
    fence,
    options,
    status_reporter,
    torchrun_group,
)

if typing.TYPE_CHECKING:
    from cairn.checkpoint import restore

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """The job this pod reports to, from the pod's environment."""

    name: str
    namespace: str
    status_interval_seconds: float


def target_from_env(env: Mapping[str, str]) -> Target | None:
    """Pure: the job to report to; None unless the operator asked this pod to report."""
    name, namespace = env.get(podenv.JOB_NAME), env.get(podenv.NAMESPACE)
    if env.get(podenv.REPORT_STATUS) != "1" or not name or not namespace:
        return None
    raw = env.get(podenv.STATUS_INTERVAL_SECONDS, "")
    try:
        interval = float(raw) if raw else status_reporter.DEFAULT_STATUS_INTERVAL_SECONDS
    except ValueError:
        raise ValueError(f"{podenv.STATUS_INTERVAL_SECONDS}={raw!r}: expected a number") from None
    return Target(name=name, namespace=namespace, status_interval_seconds=interval)


def resumed_from(result: restore.RestoreResult, *, attempt: int) -> jobstatus.ResumedFrom:
    """Pure: `status.checkpoints.resumedFrom` of a restore."""
    return jobstatus.ResumedFrom(
        step=result.step,
        attempt=attempt or None,
        source="remote" if result.source == "s3" else "local",
        tier=result.tier or ("s3" if result.source == "s3" else "local"),
        uri=result.uri,
        fell_back_from=max((s for s, _ in result.skipped), default=None),
        imported=result.imported or None,
    )


class StatusFeed:
    """Rank 0: folds checkpoint events, the step and the resume into the reporter."""

    def __init__(
        self,
        *,
        reporter: status_reporter.StatusReporter,
        previous: jobstatus.CheckpointsStatus | None,
        upload_uri: str | None,
        api_fence: fence.ApiFence | None,
    ) -> None:
        self._lock = threading.Lock()
        self._reporter = reporter
        self._tracker = checkpoint_status.continued(previous, upload_uri=upload_uri)
        self._step: int | None = None  # unknown until restored or stepped
        self.api_fence = api_fence
        """The job's UID and attempt from the API server (None without a job UID)."""

    @classmethod
    def from_env(
        cls, opts: options.CheckpointOptions, *, environ: Mapping[str, str] | None = None
    ) -> StatusFeed | None:
        """The feed the pod's environment asks for (rank 0 under the operator), else None."""
        env = os.environ if environ is None else environ
        target = target_from_env(env)
        if target is None:
            return None
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException as exc:
            log.warning("no in-cluster API access, the job's status is not reported: %s", exc)
            return None
        api_client = client.ApiClient()
        where = {"api_client": api_client, "namespace": target.namespace, "name": target.name}
        api_fence = None
        if opts.job_uid:
            api_fence = fence.ApiFence(
                get_job=status_reporter.job_reader(**where), job_uid=opts.job_uid, group=opts.group
            )
        previous = status_reporter.read_checkpoints(**where)
        if opts.group > 0 and env.get(podenv.RUNTIME, "torchrun") == "torchrun":
            # A worker group torchrun restarted in place: in status before any commit.
            last = previous.last_committed if previous is not None else None
            torchrun_group.record(
                patch=status_reporter.kubernetes_patcher(**where),
                read=status_reporter.job_reader(**where),
                attempt=opts.attempt,
                group=opts.group,
                from_step=last.step if last is not None else None,
            )
        reporter = status_reporter.StatusReporter(
            patch=status_reporter.kubernetes_patcher(**where),
            status_interval_seconds=target.status_interval_seconds,
        )
        return cls(
            reporter=reporter,
            previous=previous,
            upload_uri=opts.s3.uri if opts.s3 else None,
            api_fence=api_fence,
        )

    def on_event(self, event: events.ProgressEvent) -> None:
        """A writer progress event (any thread)."""
        with self._lock:
            now = datetime.datetime.now(datetime.UTC)
            self._tracker = checkpoint_status.apply(self._tracker, event, now=now)
            self._push()

    def on_step(self, step: int) -> None:
        """The training step just finished (a step back is taken as given: a restore)."""
        with self._lock:
            if step == self._step:
                return
            self._step = step
            self._push()

    def on_resume(self, resumed: jobstatus.ResumedFrom) -> None:
        with self._lock:
            self._tracker = checkpoint_status.resumed(self._tracker, resumed)
            self._step = resumed.step
            self._push()

    def _push(self) -> None:
        self._reporter.update(step=self._step, checkpoints=self._tracker.status)

    def close(self) -> None:
        """Deliver the last state (bounded by the reporter's close timeout)."""
        if not self._reporter.close():
            log.warning("could not deliver the final status report")
