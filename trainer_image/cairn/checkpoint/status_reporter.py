"""Rank 0's reporter of checkpoint facts to its own TrainingJob's status.

The writer knows what was committed and uploaded; the operator cannot see the
volume. So rank 0 patches `status.step` and `status.checkpoints` of its own
TrainingJob through the status subresource, with its own field manager, and
nothing else (the operator owns every other status field). Patches are
budgeted: `update()` only records the latest state, and one background
thread sends it, always the newest state, never an intermediate one twice.
The budget (`send_at`, pure): a change of checkpoint facts (a commit, an
upload, an error) is sent once `min_interval_seconds` passed since the last
patch (a save's burst of events becomes one patch); a change of only the
step or the save in flight waits `status_interval_seconds` (the job's
`checkpoint.statusIntervalSeconds`, 30 s by default: every status write is
an etcd write fanned out to every watcher); a state equal to the last one
sent is not sent. `close()` flushes the last state, so the final commit is
never lost. When the API is unreachable the thread keeps the newest state
and retries with backoff; training never blocks on it.
"""

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from cairn.api import jobstatus, trainingjob

log = logging.getLogger(__name__)

FIELD_MANAGER = "cairn-writer"
DEFAULT_MIN_INTERVAL_SECONDS = 2.0
"""Least time between any two patches: coalesces the events of one save."""
DEFAULT_STATUS_INTERVAL_SECONDS = 30.0
"""Least time between two patches that only move the step (or the save in flight)."""
MAX_BACKOFF_SECONDS = 30.0
DEFAULT_CLOSE_TIMEOUT_SECONDS = 30.0
"""How long `close()` keeps trying to deliver the final state (one request may take
its whole 10 s timeout on a slow API server, so this leaves room for retries)."""

PatchFn = Callable[[dict[str, Any]], None]


@dataclasses.dataclass(kw_only=True)
class ReporterStats:
    """What the reporter did, for tests and metrics."""

    patches_sent: int = 0
    patch_failures: int = 0
    updates: int = 0


ALWAYS_SENT = "inFlight"
"""The one writer field sent even when unset: its null clears the last save in flight."""
CLEARED_WHEN_UNSET = frozenset({ALWAYS_SENT, "uploadError", "retentionOverBudget"})
"""Writer fields whose null is sent too: a state that ended (the save in flight,
failing uploads, retention over budget) must leave the job's status, or its
condition (UploadFailing, RetentionOverBudget) would stay True for ever."""


def status_body(
    *, step: int | None, checkpoints: jobstatus.CheckpointsStatus | None
) -> dict[str, Any]:
    """Pure: the merge patch of the writer's fields, in the CRD's camelCase.

    A merge patch keeps every key it does not mention. So `inFlight`,
    `uploadError` and `retentionOverBudget` are always sent (null once the
    save in flight is done, the backlog uploaded, retention back within its
    budget), and a record that is
    sent carries its unset fields as null (a commit without a measured stall
    must not keep the previous one's). Records this writer has not made yet
    (a new attempt before its first commit) are left out, so the previous
    attempt's stay visible until replaced.
    """
    status: dict[str, Any] = {}
    if step is not None:
        status["step"] = step
    if checkpoints is not None:
        dumped = checkpoints.model_dump(mode="json", by_alias=True, exclude_none=False)
        status["checkpoints"] = {
            key: _with_deletions(value)
            for key, value in dumped.items()
            if value is not None or key in CLEARED_WHEN_UNSET
        }
    return {"status": status}


def _facts(body: dict[str, Any] | None) -> Any:
    """Pure: the checkpoint facts of a body, without the step and the save in flight."""
    if body is None:
        return None
    checkpoints = body["status"].get("checkpoints")
    if checkpoints is None:
        return None
    return {key: value for key, value in checkpoints.items() if key != ALWAYS_SENT}


def send_at(
    *,
    pending: dict[str, Any],
    delivered: dict[str, Any] | None,
    last_sent_at: float,
    min_interval_seconds: float,
    status_interval_seconds: float,
    closing: bool = False,
) -> float | None:
    """Pure: the clock time from which `pending` may be sent; None: never (it
    equals what the server already has from us).

    Every patch carries the newest step, so the step's interval counts from
    the last patch of any kind. Closing flushes a step-only change too (the
    final step must arrive), after the short interval.
    """
    if pending == delivered:
        return None
    floor = last_sent_at + min_interval_seconds
    if closing or _facts(pending) != _facts(delivered):
        return floor
    return max(floor, last_sent_at + status_interval_seconds)


def _with_deletions(value: Any) -> Any:
    """Pure: None in an object stays (a merge patch deletes the key); lists are
    replaced whole by a merge patch, so their items carry no nulls."""
    if isinstance(value, dict):
        return {key: _with_deletions(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [_without_nulls(item) for item in value]
    return value


def kubernetes_patcher(*, api_client: Any, namespace: str, name: str) -> PatchFn:
    """A PatchFn that merge-patches the TrainingJob's /status as FIELD_MANAGER."""
    from kubernetes import client

    custom = client.CustomObjectsApi(api_client)
    group, version = trainingjob.API_VERSION.split("/")

    def patch(body: dict[str, Any]) -> None:
        custom.patch_namespaced_custom_object_status(
            group,
            version,
            namespace,
            trainingjob.PLURAL,
            name,
            body,
            field_manager=FIELD_MANAGER,
            _content_type="application/merge-patch+json",
            _request_timeout=10,
        )

    return patch


def read_checkpoints(
    *, api_client: Any, namespace: str, name: str
) -> jobstatus.CheckpointsStatus | None:
    """The job's `status.checkpoints` (the job's Role may `get` its /status);
    None when there is none yet, or the API cannot be read (logged)."""
    from kubernetes import client

    group, version = trainingjob.API_VERSION.split("/")
    try:
        job = client.CustomObjectsApi(api_client).get_namespaced_custom_object_status(
            group, version, namespace, trainingjob.PLURAL, name, _request_timeout=10
        )
        raw = (job.get("status") or {}).get("checkpoints")
        return None if raw is None else jobstatus.CheckpointsStatus.model_validate(raw)
    except Exception as exc:  # reporting starts afresh; training goes on
        log.warning("could not read the previous checkpoint status: %s", exc)
        return None


def job_reader(
    *, api_client: Any, namespace: str, name: str
) -> Callable[[], dict[str, Any] | None]:
    """A `cairn.checkpoint.fence.GetJob`: GET of the job's /status (the job's
    Role may `get` it; the answer carries `metadata.uid` and `status.attempt`).
    Returns None when the job does not exist (404); other errors propagate."""
    from kubernetes import client
    from kubernetes.client import exceptions

    custom = client.CustomObjectsApi(api_client)
    group, version = trainingjob.API_VERSION.split("/")

    def read() -> dict[str, Any] | None:
        try:
            job = custom.get_namespaced_custom_object_status(
                group, version, namespace, trainingjob.PLURAL, name, _request_timeout=10
            )
        except exceptions.ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return dict(job)

    return read


class StatusReporter:
    """Throttled, never-blocking, latest-wins reporter (see module docstring)."""

    def __init__(
        self,
        *,
        patch: PatchFn,
        min_interval_seconds: float = DEFAULT_MIN_INTERVAL_SECONDS,
        status_interval_seconds: float = DEFAULT_STATUS_INTERVAL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._patch = patch
        self._interval = min_interval_seconds
        self._status_interval = status_interval_seconds
        self._delivered: dict[str, Any] | None = None
        self._clock = clock
        self._lock = threading.Condition()
        self._pending: dict[str, Any] | None = None
        self._closed = False
        self._close_deadline = float("inf")
        self._give_up = False
        self._last_sent_at = -float("inf")
        self.stats = ReporterStats()
        self._thread = threading.Thread(target=self._run, name="cairn-status-reporter", daemon=True)
        self._thread.start()

    def update(self, *, step: int | None, checkpoints: jobstatus.CheckpointsStatus | None) -> None:
        """Record the newest state; returns at once."""
        body = status_body(step=step, checkpoints=checkpoints)
        with self._lock:
            self._pending = body
            self.stats.updates += 1
            self._lock.notify()

    def close(self, *, timeout_seconds: float = DEFAULT_CLOSE_TIMEOUT_SECONDS) -> bool:
        """Send the last state (waiting out the throttle) and stop; False if it could not.

        A failed send is retried (throttled as always) until the timeout,
        which bounds the whole flush; a backoff in progress is cut short.
        """
        with self._lock:
            self._closed = True
            self._close_deadline = self._clock() + timeout_seconds
            self._lock.notify()
        self._thread.join(timeout_seconds)
        with self._lock:
            self._give_up = True  # a send still running when we return is not waited for
            return self._pending is None and not self._thread.is_alive()

    def _run(self) -> None:
        backoff = self._interval
        while True:
            with self._lock:
                while self._pending is None and not self._closed:
                    self._lock.wait()
                if self._pending is None:
                    return
                due = send_at(
                    pending=self._pending,
                    delivered=self._delivered,
                    last_sent_at=self._last_sent_at,
                    min_interval_seconds=self._interval,
                    status_interval_seconds=self._status_interval,
                    closing=self._closed,
                )
                if due is None:  # nothing new for the server: no write
                    self._pending = None
                    continue
                wait = due - self._clock()
                if wait > 0:
                    # Latest-wins: updates arriving meanwhile replace the pending body.
                    self._lock.wait(wait)
                    continue
                body = self._pending
                self._pending = None
            try:
                self._patch(body)
            except Exception as exc:  # any API failure: keep training, retry later
                log.warning("status patch failed, will retry: %s", exc)
                with self._lock:
                    self.stats.patch_failures += 1
                    if self._pending is None:
                        self._pending = body
                    self._last_sent_at = self._clock()
                    # Back off, but wake at once for close(): the final state is
                    # then retried promptly until close()'s deadline.
                    until = self._clock() + min(backoff, MAX_BACKOFF_SECONDS)
                    while not self._closed and (wait := until - self._clock()) > 0:
                        self._lock.wait(wait)
                    if self._closed and (self._give_up or self._clock() >= self._close_deadline):
                        return
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
                continue
            backoff = self._interval
            with self._lock:
                self.stats.patches_sent += 1
                self._delivered = body
                self._last_sent_at = self._clock()
