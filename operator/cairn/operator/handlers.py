"""kopf handlers: one serialized reconcile loop per TrainingJob.

The only module that imports kopf. Each TrainingJob gets a daemon that runs
``observe -> plan.plan() -> effects.apply()`` and then sleeps until something
kicks it (a change of the job, a change of one of its pods) or until the
plan's ``requeue_after`` (at most ``RESYNC_SECONDS``). One daemon per job
means reconciles of a job never overlap. Pods are watched once, for every
job, through the ``cairn.dev/job-name`` label and kept in a kopf index
already reduced to ``observe.ObservedPod``. The index is only a cache: kopf
drops a pod on a DELETED event, and a watch that broke and re-listed never
sends one for a pod deleted in the gap. So on every timed wake-up (resync,
requeue) and after a delete found a pod already gone (404), the loop lists
the job's pods from the API by label selector and plans from that list;
pods the list showed gone are hidden from later index reads (``_PodTruth``).

A second daemon per job runs the S3 pass (``storage.storage_pass``:
verification, remote retention, ``status.storage``) every
``tunables.StorageLoop.interval_seconds`` when ``spec.checkpoint.upload`` is set, and
within a second of the writer reporting a new ``lastUploaded`` step. The
deletion handler applies ``onDelete: Delete`` before kopf releases the
finalizer, bounded: after ``cleanup_attempts`` failures it posts
``CleanupFailed`` and lets the deletion complete.

Run: ``kopf run -m cairn.operator.handlers --all-namespaces``.
"""

import asyncio
import concurrent.futures
import contextlib
import copy
import datetime
import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import kopf
from kubernetes import client, config
from kubernetes.client import exceptions as k8s_exceptions
from kubernetes.config import config_exception

from cairn.api import trainingjob
from cairn.operator import (
    effects,
    k8stypes,
    metrics,
    names,
    observe,
    plan,
    prefixowner,
    s3store,
    storage,
    ttl,
    tunables,
)

LOG = logging.getLogger(__name__)
RESYNC_SECONDS = 60.0
ERROR_RETRY_SECONDS = 5.0
FINALIZER = "cairn.dev/finalizer"
STORAGE = tunables.DEFAULT.storage
# S3 work runs in its own threads: a slow or unreachable store (botocore
# retries, timeouts) never takes the threads the reconcile loops use.
_storage_pool = concurrent.futures.ThreadPoolExecutor(
    max_workers=STORAGE.threads, thread_name_prefix="cairn-s3"
)
_T = TypeVar("_T")


async def _in_storage_thread(call: Callable[..., _T], /, *args: Any, **kwargs: Any) -> _T:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_storage_pool, functools.partial(call, *args, **kwargs))


_kicks: dict[tuple[str, str], asyncio.Event] = {}
_storage_kicks: dict[tuple[str, str], asyncio.Event] = {}
_uploaded_seen: dict[tuple[str, str], int | None] = {}


def clock() -> datetime.datetime:
    """The operator's clock; plan() gets time only through here."""
    return datetime.datetime.now(datetime.UTC)


def _kick(namespace: str | None, name: str | None) -> None:
    event = _kicks.get((namespace or "", name or ""))
    if event is not None:
        event.set()


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="cairn.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="cairn.dev", key="last-handled-configuration"
    )
    settings.posting.enabled = False  # plan() emits the events that matter
    # Server-side filter: the API server sends only pods carrying the job label,
    # so other pods in the cluster are never decoded here (the handlers'
    # `labels=` filters below run client-side, after decoding).
    settings.watching.label_selectors["pods"] = names.LABEL_JOB
    try:
        config.load_incluster_config()
    except config_exception.ConfigException:
        config.load_kube_config()
    memo["api"] = client.ApiClient()


@kopf.index("pods", labels={names.LABEL_JOB: kopf.PRESENT})
async def pods_by_job(
    namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[tuple[str, str], observe.ObservedPod] | None:
    pod = observe.parse_pod(copy.deepcopy(dict(body)))
    if pod is None:
        return None
    return {(namespace or "", labels[names.LABEL_JOB]): pod}


@kopf.on.event("pods", labels={names.LABEL_JOB: kopf.PRESENT})
async def pod_changed(namespace: str | None, labels: kopf.Labels, **_: Any) -> None:
    _kick(namespace, labels.get(names.LABEL_JOB))


def _uploaded_step(body: Any) -> int | None:
    try:
        step = body["status"]["checkpoints"]["lastUploaded"]["step"]
    except (KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


@kopf.on.event(trainingjob.GROUP, trainingjob.VERSION, trainingjob.PLURAL)
async def job_changed(
    namespace: str | None, name: str | None, type: str | None, body: kopf.Body, **_: Any
) -> None:
    _kick(namespace, name)
    key = (namespace or "", name or "")
    if type == "DELETED":
        metrics.JOBS.forget(*key)
        return
    metrics.JOBS.observe(*key, body)
    uploaded = _uploaded_step(body)
    if uploaded is not None and _uploaded_seen.get(key) != uploaded:
        _uploaded_seen[key] = uploaded
        event = _storage_kicks.get(key)
        if event is not None:
            event.set()


class _Written:
    """The job as our last status patch returned it, and the resourceVersion it
    replaced: while the watch still shows that old version, or any version
    older than ours (kopf's own finalizer and annotation patches land between
    the two), plan from ours, so a transition is never decided (and announced)
    twice."""

    def __init__(self) -> None:
        self.replaced: str | None = None
        self.body: dict[str, Any] | None = None

    def freshest(self, live: dict[str, Any]) -> dict[str, Any]:
        if self.body is None:
            return live
        version = live.get("metadata", {}).get("resourceVersion")
        ours = self.body.get("metadata", {}).get("resourceVersion")
        if version == self.replaced or _older(version, than=ours):
            return self.body
        self.body = None  # the watch caught up: it is the truth again
        return live

    def record(self, planned_from: dict[str, Any], patched: dict[str, Any] | None) -> None:
        """Our status patch of `planned_from` returned `patched` (None: no patch)."""
        if patched is not None:
            self.replaced = planned_from.get("metadata", {}).get("resourceVersion")
            self.body = patched


def _older(version: object, *, than: object) -> bool:
    """Whether resourceVersion `version` precedes `than`. The API server's are
    etcd revisions (integers, increasing cluster-wide); anything else: unknown."""
    try:
        return int(str(version)) < int(str(than))
    except ValueError:
        return False


class _PodTruth:
    """One job's pods as the plan should see them, and what the last apply
    could not create. kopf's index, minus the pods a fresh API list showed gone."""

    def __init__(self) -> None:
        self.ghosts: set[str] = set()
        self.list_next = True
        self.create_errors: tuple[observe.CreateError, ...] = ()

    def from_list(
        self, *, cached: tuple[observe.ObservedPod, ...], listed: tuple[observe.ObservedPod, ...]
    ) -> tuple[observe.ObservedPod, ...]:
        present = {p.uid for p in listed}
        self.ghosts = {p.uid for p in cached if p.uid not in present}
        self.list_next = False
        return listed

    def from_cache(
        self, cached: tuple[observe.ObservedPod, ...]
    ) -> tuple[observe.ObservedPod, ...]:
        self.ghosts &= {p.uid for p in cached}  # forget those kopf dropped by now
        return tuple(p for p in cached if p.uid not in self.ghosts)


def _list_pods(api: Any, namespace: str, name: str) -> tuple[observe.ObservedPod, ...]:
    """The job's pods straight from the API server (not the watch cache)."""
    listed = client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"{names.LABEL_JOB}={name}"
    )
    parsed = (observe.parse_pod(api.sanitize_for_serialization(p)) for p in listed.items)
    return tuple(p for p in parsed if p is not None)


async def reconcile_once(
    *,
    body: kopf.Body,
    pods: kopf.Index[tuple[str, str], observe.ObservedPod],
    api: Any,
    written: _Written,
    truth: _PodTruth | None = None,
    fresh: bool = False,
) -> float:
    """One observe -> plan -> apply cycle; returns how long to sleep. ``fresh``:
    plan from a pod list read from the API instead of the index."""
    truth = truth or _PodTruth()
    raw = written.freshest(copy.deepcopy(dict(body)))
    meta = raw.get("metadata", {})
    namespace, name = meta.get("namespace", ""), meta.get("name", "")
    job = observe.parse_job(raw)
    cached = tuple(pods.get((namespace, name), ()))
    if fresh or truth.list_next:
        listed = await asyncio.to_thread(_list_pods, api, namespace, name)
        known = set(truth.ghosts)
        current = truth.from_list(cached=cached, listed=listed)
        if truth.ghosts - known:  # once per ghost: kopf may keep it forever
            LOG.info(
                "%s/%s: %d pod(s) in the watch cache are gone from the API; planning without them",
                namespace,
                name,
                len(truth.ghosts),
            )
    else:
        current = truth.from_cache(cached)
    seen = tuple(sorted(current, key=lambda p: (p.attempt, p.rank)))
    observed = observe.Observed(pods=seen, create_errors=truth.create_errors)
    todo = plan.plan(job=job, observed=observed, now=clock())
    if not todo.empty:
        ref = effects.JobRef.of(raw)
        result = await asyncio.to_thread(effects.apply, api=api, job=ref, todo=todo, now=clock)
        written.record(raw, result.patched_object)
        truth.create_errors = result.create_errors
        if result.gone:
            truth.list_next = True
        decision = todo.decision
        LOG.info(
            "reconciled %s/%s phase=%s created=%s deleted=%s",
            namespace,
            name,
            decision.phase if decision else "?",
            ",".join(result.created) or "-",
            ",".join(result.deleted) or "-",
        )
    wait = todo.requeue_after if todo.requeue_after is not None else RESYNC_SECONDS
    return min(max(wait, 0.5), RESYNC_SECONDS)


@kopf.daemon(
    trainingjob.GROUP,
    trainingjob.VERSION,
    trainingjob.PLURAL,
    cancellation_timeout=1.0,
)
async def reconcile_loop(
    *,
    namespace: str | None,
    name: str,
    body: kopf.Body,
    stopped: kopf.DaemonStopped,
    memo: kopf.Memo,
    **kwargs: Any,
) -> None:
    # kopf injects every index by its handler's name.
    pods: kopf.Index[tuple[str, str], observe.ObservedPod] = kwargs["pods_by_job"]
    key = (namespace or "", name)
    kick = _kicks.setdefault(key, asyncio.Event())
    written = _Written()
    truth = _PodTruth()
    timed_out = True
    try:
        while not stopped:
            kick.clear()
            started = time.monotonic()
            try:
                wait = await reconcile_once(
                    body=body,
                    pods=pods,
                    api=memo["api"],
                    written=written,
                    truth=truth,
                    fresh=timed_out,
                )
            except k8s_exceptions.ApiException as error:
                LOG.warning("reconcile of %s/%s failed: %s", *key, error.reason)
                wait = ERROR_RETRY_SECONDS
            finally:
                metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
            timed_out = False
            try:
                await asyncio.wait_for(kick.wait(), timeout=wait)
            except TimeoutError:
                timed_out = True  # a resync or requeue: plan from a fresh list
    finally:
        _kicks.pop(key, None)


def _s3_job(raw: dict[str, Any]) -> tuple[dict[str, Any], trainingjob.TrainingJob] | None:
    """The job if the operator should look at its S3 prefix now, else None."""
    job = observe.parse_job(raw)
    if isinstance(job, observe.InvalidJob) or not job.spec.managed_by_cairn:
        return None
    if job.spec.checkpoint.upload is None or job.metadata.deletion_timestamp is not None:
        return None
    return raw, job


async def _sleep(kick: asyncio.Event, stopped: kopf.DaemonStopped, timeout: float) -> None:
    """Until kicked, stopped (the job is being deleted) or ``timeout``."""
    waits = [asyncio.ensure_future(kick.wait()), asyncio.ensure_future(stopped.wait())]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()


@kopf.daemon(
    trainingjob.GROUP,
    trainingjob.VERSION,
    trainingjob.PLURAL,
    cancellation_timeout=1.0,
    initial_delay=STORAGE.initial_delay_seconds,
)
async def storage_loop(
    *,
    namespace: str | None,
    name: str,
    body: kopf.Body,
    stopped: kopf.DaemonStopped,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """The S3 pass of one job, every ``STORAGE.interval_seconds`` or when kicked."""
    key = (namespace or "", name)
    kick = _storage_kicks.setdefault(key, asyncio.Event())
    cache = s3store.HeadCache()
    written = _Written()
    try:
        while not stopped:
            kick.clear()
            target = _s3_job(written.freshest(copy.deepcopy(dict(body))))
            if target is not None:
                raw, job = target
                started = time.monotonic()
                try:
                    result = await _in_storage_thread(
                        storage.storage_pass,
                        api=memo["api"],
                        raw=raw,
                        job=job,
                        cache=cache,
                        now=clock,
                    )
                    written.record(raw, result.patched_object)
                    if result.error is not None:
                        metrics.STORAGE_ERRORS.inc()
                    metrics.RETENTION_DELETED.inc(len(result.deleted))
                except k8s_exceptions.ApiException as error:
                    LOG.warning("storage status of %s/%s not patched: %s", *key, error.reason)
                except Exception:  # keep the loop alive; the next pass tries again
                    LOG.exception("S3 pass of %s/%s failed", *key)
                    metrics.STORAGE_ERRORS.inc()
                finally:
                    metrics.STORAGE_PASS_SECONDS.observe(time.monotonic() - started)
            await _sleep(kick, stopped, STORAGE.interval_seconds)
    finally:
        _storage_kicks.pop(key, None)
        _uploaded_seen.pop(key, None)


POD_GONE_MARGIN_SECONDS = 30.0
POD_GONE_POLL_SECONDS = 1.0


def _live_pods(api: Any, job: trainingjob.TrainingJob) -> list[str]:
    pods = client.CoreV1Api(api).list_namespaced_pod(
        job.metadata.namespace, label_selector=f"{names.LABEL_JOB}={job.metadata.name}"
    )
    return [p.metadata.name for p in pods.items]


def _delete_pods(api: Any, namespace: str, pods: list[str]) -> None:
    for pod in pods:
        try:
            client.CoreV1Api(api).delete_namespaced_pod(pod, namespace)
        except k8s_exceptions.ApiException as error:
            if error.status != 404:
                raise


async def _pods_gone(api: Any, job: trainingjob.TrainingJob) -> None:
    """Delete the job's pods (their grace period lets the writer finish) and wait,
    bounded by that grace period plus a margin, until the API server has none."""
    bound = job.spec.checkpoint.final_checkpoint_grace_seconds + POD_GONE_MARGIN_SECONDS
    deadline = time.monotonic() + bound
    pods = await asyncio.to_thread(_live_pods, api, job)
    if pods:
        await asyncio.to_thread(_delete_pods, api, job.metadata.namespace, pods)
    while pods and time.monotonic() < deadline:
        await asyncio.sleep(POD_GONE_POLL_SECONDS)
        pods = await asyncio.to_thread(_live_pods, api, job)
    if pods:
        LOG.warning(
            "onDelete of %s/%s: pods %s still exist after %.0f s; cleaning up anyway",
            job.metadata.namespace,
            job.metadata.name,
            ",".join(pods),
            bound,
        )


@kopf.on.delete(trainingjob.GROUP, trainingjob.VERSION, trainingjob.PLURAL)
async def on_delete(*, body: kopf.Body, memo: kopf.Memo, retry: int, **_: Any) -> None:
    """``onDelete: Delete``: empty the job's S3 prefix before the finalizer goes.

    Bounded: each failed attempt raises ``kopf.TemporaryError`` with a
    doubling delay (kopf keeps the retry count in the job's ``cairn.dev``
    annotations, so an operator restart does not reset it); the
    ``STORAGE.cleanup_attempts``-th failure posts a Warning ``CleanupFailed`` and returns,
    so the finalizer is released and a deletion never wedges on an
    unreachable store. ``Retain`` touches nothing. The job's pods are deleted
    and gone first (bounded); a prefix the job does not own, or a store the
    operator's settings refuse, is left alone with a ``CleanupSkipped`` Warning.
    """
    raw = copy.deepcopy(dict(body))
    job = observe.parse_job(raw)
    if isinstance(job, observe.InvalidJob):
        return
    checkpoint = job.spec.checkpoint
    if not job.spec.managed_by_cairn or checkpoint.on_delete != "Delete" or not checkpoint.upload:
        s3store.forget_credentials(job.metadata.uid)
        return
    key = (job.metadata.namespace, job.metadata.name)
    attempt = retry + 1
    # Pods still uploading would leave orphans behind the deletion: stop them first.
    await _pods_gone(memo["api"], job)
    try:
        count = await _in_storage_thread(storage.cleanup, api=memo["api"], raw=raw, job=job)
    except prefixowner.NotOwnedError as refused:
        notice = k8stypes.Event(
            type="Warning",
            reason="CleanupSkipped",
            message=f"onDelete: Delete did not delete under {checkpoint.upload.uri}: "
            f"{refused.claim.message}",
        )
        await _in_storage_thread(
            effects.post_event, memo["api"], effects.JobRef.of(raw), notice, now=clock()
        )
        s3store.forget_credentials(job.metadata.uid)
        return
    except s3store.StoreError as failure:
        LOG.warning("cleanup of %s/%s, attempt %d: %s", *key, attempt, failure)
        if attempt < STORAGE.cleanup_attempts:
            raise kopf.TemporaryError(
                f"S3 cleanup attempt {attempt} failed",
                delay=STORAGE.cleanup_backoff_seconds * 2 ** (attempt - 1),
            ) from None
        notice = k8stypes.Event(
            type="Warning",
            reason="CleanupFailed",
            message=f"S3 prefix {checkpoint.upload.uri} not emptied after {attempt} attempts: {failure}",
        )
        await _in_storage_thread(
            effects.post_event, memo["api"], effects.JobRef.of(raw), notice, now=clock()
        )
        s3store.forget_credentials(job.metadata.uid)
        return
    LOG.info("onDelete=Delete: removed %d objects of %s/%s from S3", count, *key)
    s3store.forget_credentials(job.metadata.uid)


def _ttl_pending(body: kopf.Body, **_: Any) -> bool:
    return ttl.due_at(body) is not None


def _delete_expired(api: Any, raw: dict[str, Any]) -> None:
    ref = effects.JobRef.of(raw)
    event = k8stypes.Event(type="Normal", reason=ttl.EVENT_REASON, message=ttl.message(raw))
    effects.post_event(api, ref, event, now=clock())
    try:
        client.CustomObjectsApi(api).delete_namespaced_custom_object(
            trainingjob.GROUP,
            trainingjob.VERSION,
            ref.namespace,
            trainingjob.PLURAL,
            ref.name,
            propagation_policy="Background",
        )
    except k8s_exceptions.ApiException as error:
        if error.status != 404:
            raise


@kopf.daemon(
    trainingjob.GROUP,
    trainingjob.VERSION,
    trainingjob.PLURAL,
    cancellation_timeout=1.0,
    when=_ttl_pending,
)
async def ttl_loop(
    *, body: kopf.Body, stopped: kopf.DaemonStopped, memo: kopf.Memo, **_: Any
) -> None:
    """``spec.ttlSecondsAfterFinished``: runs only while a finished job has a TTL
    (kopf starts and stops it as the filter changes); deletes it when due."""
    while not stopped:
        left = ttl.seconds_left(body, now=clock())
        if left is None:
            return
        if left > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopped.wait(), timeout=min(left, RESYNC_SECONDS))
            continue
        try:
            await asyncio.to_thread(_delete_expired, memo["api"], copy.deepcopy(dict(body)))
        except k8s_exceptions.ApiException as error:
            LOG.warning(
                "TTL deletion of %s failed: %s", body.get("metadata", {}).get("name"), error.reason
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopped.wait(), timeout=ERROR_RETRY_SECONDS)
            continue
        return
