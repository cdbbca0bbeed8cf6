"""kopf handlers: one serialized reconcile loop per live TrainingJob.

The only module that imports kopf. Each TrainingJob that is not Succeeded or
Failed gets a daemon (kopf ``when=`` filter) that runs ``observe ->
plan.plan() -> effects.apply()`` and then sleeps until something kicks it (a
change of the job, a change of one of its pods) or until the plan's
``requeue_after`` (at most ``tunables.Reconcile.resync_seconds``). One daemon
per job means reconciles of a job never overlap. A job that finished loses
its daemon (kopf stops it when the filter turns false); what is left to do
for it (stopping its pods, ``cleanup.finishedPods``, its Kueue Workload) is
one reconcile from one shared task (``_Finished``) whenever the job or one
of its pods changes. Pods are not watched by kopf: one reflector of the
operator's own (``podcache``: list, watch, re-list after 410 Gone) keeps
every job's pods reduced to ``observe.ObservedPod`` and kicks a job when
what its plan sees of them changed. No reconcile runs before that first
list is in. After a delete found a pod already gone (404) the next plan
lists the job's pods from the API by label selector; pods that list showed
gone are hidden from later cache reads until the cache drops them too
(``_PodTruth``). Pods are attached to a job by label, but only its own
(``podowner``: controller ownerReference and name) are planned from or
deleted, onDelete included; each stranger is reported once (``ForeignPod``).

The S3 pass (``s3pass.storage_pass``: verification, remote retention,
``status.storage``) of every job runs from one scheduler task
(``s3loop.S3Loop``): live jobs with ``spec.checkpoint.upload`` every
``tunables.StorageLoop.interval_seconds`` and within a second of the writer
reporting a new ``lastUploaded`` step, finished jobs once. The deletion
handler applies ``onDelete: Delete`` before kopf releases the finalizer,
bounded: after ``cleanup_attempts`` failures it posts ``CleanupFailed`` and
lets the deletion complete.

Run: ``kopf run -m cairn.operator.handlers --all-namespaces``.
"""

import asyncio
import concurrent.futures
import copy
import datetime
import functools
import json
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import kopf
from kubernetes import client, config
from kubernetes.client import exceptions as k8s_exceptions
from kubernetes.config import config_exception

from cairn.api import jobstatus, trainingjob
from cairn.operator import (
    effects,
    k8stypes,
    kueue,
    kueuesync,
    metrics,
    names,
    observe,
    plan,
    podcache,
    podowner,
    prefixowner,
    s3loop,
    s3observe,
    s3pass,
    ttl,
    tunables,
)

LOG = logging.getLogger(__name__)
FINALIZER = "cairn.dev/finalizer"
SETTINGS = tunables.DEFAULT
RECONCILE = SETTINGS.reconcile
STORAGE = SETTINGS.storage
# S3 work runs in its own threads: a slow or unreachable store (botocore
# retries, timeouts) never takes the threads the reconcile loops use.
_storage_pool = concurrent.futures.ThreadPoolExecutor(
    max_workers=STORAGE.threads, thread_name_prefix="cairn-s3"
)
_T = TypeVar("_T")


async def _in_storage_thread(call: Callable[..., _T], /, *args: Any, **kwargs: Any) -> _T:
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_storage_pool, functools.partial(call, *args, **kwargs))


Key = tuple[str, str]
_kicks: dict[Key, asyncio.Event] = {}
_locks: dict[Key, asyncio.Lock] = {}
"""One per job: a finished job's reconcile waits for its stopping daemon's."""
_foreign_reported: dict[Key, frozenset[str]] = {}
"""Per job, the foreign pods (``podowner``) already reported in a ForeignPod
Event: each once per job and pod (again after an operator restart)."""


def _lock(key: Key) -> asyncio.Lock:
    return _locks.setdefault(key, asyncio.Lock())


def finished(raw: Mapping[str, Any]) -> bool:
    """Whether the job is Succeeded or Failed (its status says so). Pure."""
    status = raw.get("status")
    return isinstance(status, Mapping) and status.get("phase") in jobstatus.TERMINAL_PHASES


def clock() -> datetime.datetime:
    """The operator's clock; plan() gets time only through here."""
    return datetime.datetime.now(datetime.UTC)


PODS = podcache.PodCache()
"""Every job's pods; ``configure`` starts the reflector that fills it."""
WATCH_NAMESPACES: list[str] | None = None
"""The namespaces kopf watches (``__main__``); None: every namespace."""
PODS_LISTED = asyncio.Event()
"""Set (on the loop) once the reflector's first list is in."""


async def _pods_ready(stopped: kopf.DaemonStopped | None = None) -> None:
    """Until the pod cache holds the first full list (or the daemon is stopped)."""
    if stopped is None:
        await PODS_LISTED.wait()
        return
    while not PODS_LISTED.is_set() and not stopped:
        await _sleep(PODS_LISTED, stopped, RECONCILE.resync_seconds)


def _kick(namespace: str | None, name: str | None) -> None:
    key = (namespace or "", name or "")
    event = _kicks.get(key)
    if event is not None:
        event.set()
    else:
        FINISHED.enqueue(key)  # a finished job has no daemon to wake


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="cairn.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="cairn.dev", key="last-handled-configuration"
    )
    settings.posting.enabled = False  # plan() emits the events that matter
    try:
        config.load_incluster_config()
    except config_exception.ConfigException:
        config.load_kube_config()
    configuration = client.Configuration.get_default_copy()
    configuration.connection_pool_maxsize = RECONCILE.api_threads
    memo["api"] = client.ApiClient(configuration)
    # Every job's blocking API calls (asyncio.to_thread) share the loop's default
    # executor; its default size (cores + 4) queues a burst of reconciles behind
    # each other, though they mostly wait on the API server.
    asyncio.get_running_loop().set_default_executor(
        concurrent.futures.ThreadPoolExecutor(
            max_workers=RECONCILE.api_threads, thread_name_prefix="cairn-api"
        )
    )
    memo["tasks"] = [
        asyncio.create_task(S3_LOOP.run(), name="cairn S3 passes"),
        asyncio.create_task(FINISHED.run(), name="cairn finished jobs"),
    ]
    S3_API.append(memo["api"])
    loop = asyncio.get_running_loop()

    def changed(key: Key) -> None:  # from the reflector's thread
        loop.call_soon_threadsafe(_kick, *key)

    def ready() -> None:
        loop.call_soon_threadsafe(PODS_LISTED.set)

    PODS.on_change = changed
    # Its own client: the watch holds a connection for minutes at a time.
    memo["pods_stop"] = podcache.start(
        api=client.ApiClient(configuration),
        cache=PODS,
        namespaces=WATCH_NAMESPACES,
        on_ready=ready,
    )


@kopf.on.cleanup()
async def stop_shared_tasks(memo: kopf.Memo, **_: Any) -> None:
    for task in memo.get("tasks", ()):
        task.cancel()
    if "pods_stop" in memo:
        memo["pods_stop"].set()


@kopf.on.event(kueue.GROUP, kueue.VERSION, kueue.PLURAL, labels={names.LABEL_JOB: kopf.PRESENT})
async def workload_changed(namespace: str | None, body: kopf.Body, **_: Any) -> None:
    """A queued job's Workload changed (admitted, evicted...): reconcile its owner."""
    for owner in body.get("metadata", {}).get("ownerReferences") or ():
        if owner.get("kind") == trainingjob.KIND and owner.get("controller"):
            _kick(namespace, owner.get("name"))


@kopf.on.event(trainingjob.GROUP, trainingjob.VERSION, trainingjob.PLURAL)
async def job_changed(
    namespace: str | None,
    name: str | None,
    type: str | None,
    body: kopf.Body,
    memo: kopf.Memo,
    **kwargs: Any,
) -> None:
    key = (namespace or "", name or "")
    if type == "DELETED":
        metrics.JOBS.forget(*key)
        S3_LOOP.forget(key)
        FINISHED.forget(key)
        _locks.pop(key, None)
        _foreign_reported.pop(key, None)
        return
    metrics.JOBS.observe(*key, body)
    raw = copy.deepcopy(dict(body))
    S3_LOOP.update(key, raw)
    if finished(raw):
        FINISHED.note(key, raw, api=memo["api"])
    else:
        FINISHED.forget(key)
        _kick(namespace, name)


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
    could not create. The pod cache, minus the pods a fresh API list showed gone.

    Expectations (as the Job controller keeps them): the pods the last apply
    created are awaited in the cache before the next plan, for at most
    ``tunables.Reconcile.expectation_seconds``; a reconcile woken by the
    first of them would otherwise re-create the others (409s, one POST each).
    """

    def __init__(self, *, list_first: bool = True) -> None:
        self.ghosts: set[str] = set()
        self.list_next = list_first
        self.create_errors: tuple[observe.CreateError, ...] = ()
        self.expected: frozenset[str] = frozenset()
        self.expected_until = 0.0

    def expect(self, created: Iterable[str], *, until: float) -> None:
        """Pods (by name) the last apply created; awaited until ``until``."""
        self.expected, self.expected_until = frozenset(created), until

    def awaited(self, current: tuple[observe.ObservedPod, ...], *, now: float) -> frozenset[str]:
        """The created pods the index does not show yet, while they are awaited."""
        if now >= self.expected_until:
            self.expected = frozenset()
        missing = self.expected - {p.name for p in current}
        if not missing:
            self.expected = frozenset()
        return missing

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
    # The JSON as sent: decoding into V1Pod objects and back would cost more
    # CPU than the request (every job lists on each resync).
    response = client.CoreV1Api(api).list_namespaced_pod(
        namespace, label_selector=f"{names.LABEL_JOB}={name}", _preload_content=False
    )
    items = json.loads(response.data).get("items") or []
    parsed = (observe.parse_pod(item) for item in items)
    return tuple(p for p in parsed if p is not None)


async def reconcile_once(
    *,
    body: Mapping[str, Any],
    pods: podcache.PodCache,
    api: Any,
    written: _Written,
    truth: _PodTruth | None = None,
) -> float:
    """One observe -> plan -> apply cycle; returns how long to sleep."""
    truth = truth or _PodTruth()
    raw = written.freshest(copy.deepcopy(dict(body)))
    meta = raw.get("metadata", {})
    namespace, name = meta.get("namespace", ""), meta.get("name", "")
    job = observe.parse_job(raw)
    cached = tuple(pods.get((namespace, name), ()))
    if truth.list_next:
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
        truth.expected = frozenset()  # the list is the truth
    else:
        current = truth.from_cache(cached)
        if truth.awaited(current, now=time.monotonic()):
            return max(truth.expected_until - time.monotonic(), RECONCILE.min_requeue_seconds)
    seen = tuple(sorted(current, key=lambda p: (p.attempt, p.rank)))
    # Kueue (only for jobs labelled kueue.x-k8s.io/queue-name): the Workload gates the plan.
    queue = None
    if not isinstance(job, observe.InvalidJob) and kueue.queue_name(job) is not None:
        # Only a queued job's reconcile waits for a worker thread here: the
        # threads are shared by every job's API calls.
        queue = await asyncio.to_thread(kueuesync.read, api, job)
    observed = observe.Observed(
        pods=seen,
        create_errors=truth.create_errors,
        queue=queue,
        reported_foreign=_foreign_reported.get((namespace, name), frozenset()),
    )
    todo = plan.plan(job=job, observed=observed, now=clock())
    if not todo.empty:
        ref = effects.JobRef.of(raw)
        result = await asyncio.to_thread(effects.apply, api=api, job=ref, todo=todo, now=clock)
        written.record(raw, result.patched_object)
        truth.create_errors = result.create_errors
        pods_created = (c.split("/", 1)[1] for c in result.created if c.startswith("Pod/"))
        truth.expect(pods_created, until=time.monotonic() + RECONCILE.expectation_seconds)
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
    # After the apply (its events posted), or none was needed: never before.
    if todo.foreign_reported:
        _foreign_reported[(namespace, name)] = todo.foreign_reported
    else:
        _foreign_reported.pop((namespace, name), None)
    wait = todo.requeue_after if todo.requeue_after is not None else resync_wait()
    if queue is not None:
        again = await asyncio.to_thread(
            kueuesync.sync, api, raw=raw, job=job, queue=queue, decision=todo.decision, now=clock()
        )
        wait = min(wait, again) if again is not None else wait
    return min(max(wait, RECONCILE.min_requeue_seconds), RECONCILE.resync_seconds)


def resync_wait(
    settings: tunables.Reconcile = RECONCILE, draw: Callable[[], float] = random.random
) -> float:
    """The sleep before a resync: ``resync_seconds`` shortened by up to
    ``resync_jitter`` at random, so that jobs seen at the same moment (an
    operator start) spread their reconciles over the interval."""
    return settings.resync_seconds * (1.0 - settings.resync_jitter * draw())


def _live(body: kopf.Body, **_: Any) -> bool:
    """The reconcile daemon's kopf filter: only a job that did not finish has one."""
    return not finished(body)


async def _sleep(kick: asyncio.Event, stopped: kopf.DaemonStopped, timeout: float) -> None:
    """Until kicked, stopped (the job finished or is being deleted) or ``timeout``."""
    waits = [asyncio.ensure_future(kick.wait()), asyncio.ensure_future(stopped.wait())]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()


async def _reconcile_guarded(key: Key, **call: Any) -> float | None:
    """``reconcile_once`` under the job's lock; None after an API error (logged)."""
    started = time.monotonic()
    try:
        async with _lock(key):
            return await reconcile_once(**call)
    except k8s_exceptions.ApiException as error:
        LOG.warning("reconcile of %s/%s failed: %s", *key, error.reason)
        return None
    finally:
        metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)


@kopf.daemon(
    trainingjob.GROUP,
    trainingjob.VERSION,
    trainingjob.PLURAL,
    cancellation_timeout=RECONCILE.stop_timeout_seconds,
    when=_live,
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
    """The reconcile loop of a job that did not finish (kopf stops it when it does)."""
    del kwargs
    key = (namespace or "", name)
    kick = _kicks.setdefault(key, asyncio.Event())
    written = _Written()
    # The first reconcile (on an operator start, for every job at once) plans
    # from the pod cache's first full list, never from a half-filled cache.
    await _pods_ready(stopped)
    truth = _PodTruth(list_first=False)
    try:
        while not stopped:
            kick.clear()
            wait = await _reconcile_guarded(
                key, body=body, pods=PODS, api=memo["api"], written=written, truth=truth
            )
            await _sleep(kick, stopped, wait or RECONCILE.error_retry_seconds)
    finally:
        if _kicks.get(key) is kick:
            _kicks.pop(key, None)


class _Finished:
    """Succeeded and Failed jobs: no daemon, one shared task.

    What is left to do for a finished job (stop its pods, ``cleanup.finishedPods``,
    its Kueue Workload) is one reconcile, planned from the pod cache, each
    time the job or one of its pods changes, one job at a time; a job with
    ``ttlSecondsAfterFinished`` gets a timer (an asyncio ``TimerHandle``, not a
    task) that deletes it when due. Only the last body of each finished job is
    kept.
    """

    def __init__(self) -> None:
        self.bodies: dict[Key, dict[str, Any]] = {}
        self._pending: dict[Key, None] = {}  # insertion-ordered set
        self._expired: dict[Key, None] = {}
        self._timers: dict[Key, asyncio.TimerHandle] = {}
        self._wake = asyncio.Event()
        self._api: Any = None
        self.reconciles = 0

    def note(self, key: Key, raw: dict[str, Any], *, api: Any) -> None:
        self.bodies[key] = raw
        self._api = api
        self._set_timer(key, ttl.seconds_left(raw, now=clock()))
        self.enqueue(key)

    def forget(self, key: Key) -> None:
        self.bodies.pop(key, None)
        self._pending.pop(key, None)
        self._set_timer(key, None)

    def enqueue(self, key: Key) -> None:
        if key in self.bodies:
            self._pending[key] = None
            self._wake.set()

    def _set_timer(self, key: Key, seconds: float | None) -> None:
        """The job's TTL timer: (re)set to ``seconds``, or none."""
        old = self._timers.pop(key, None)
        if old is not None:
            old.cancel()
        self._expired.pop(key, None)
        if seconds is not None:
            loop = asyncio.get_running_loop()
            self._timers[key] = loop.call_later(max(seconds, 0.0), self._expire, key)

    def _expire(self, key: Key) -> None:
        self._timers.pop(key, None)
        self._expired[key] = None
        self._wake.set()

    async def run(self) -> None:
        await _pods_ready()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._pending or self._expired:
                if self._expired:
                    key = next(iter(self._expired))
                    del self._expired[key]
                    await self._delete_if_due(key)
                    continue
                key = next(iter(self._pending))
                del self._pending[key]
                await self._reconcile(key)

    async def _reconcile(self, key: Key) -> None:
        raw = self.bodies.get(key)
        if raw is None:
            return
        truth = _PodTruth(list_first=False)
        self.reconciles += 1
        wait = await _reconcile_guarded(
            key, body=raw, pods=PODS, api=self._api, written=_Written(), truth=truth
        )
        if wait is None:  # an API error: try this job again later
            asyncio.get_running_loop().call_later(RECONCILE.error_retry_seconds, self.enqueue, key)

    async def _delete_if_due(self, key: Key) -> None:
        """``spec.ttlSecondsAfterFinished``: post ``TTLExpired``, delete the job."""
        raw = self.bodies.get(key)
        left = ttl.seconds_left(raw, now=clock()) if raw is not None else None
        if raw is None or left is None:
            return
        if left > 0:  # the body changed since the timer was set
            self._set_timer(key, left)
            return
        try:
            await asyncio.to_thread(_delete_expired, self._api, raw)
        except k8s_exceptions.ApiException as error:
            LOG.warning("TTL deletion of %s/%s failed: %s", *key, error.reason)
            self._set_timer(key, RECONCILE.error_retry_seconds)


FINISHED = _Finished()
S3_API: list[Any] = []
"""The operator's Kubernetes client, once ``configure`` made it."""


async def _storage_pass(
    key: Key, raw: dict[str, Any], job: trainingjob.TrainingJob, caches: s3observe.Caches
) -> s3pass.PassResult | None:
    """One S3 pass in the S3 threads, with its metrics; None if the status patch failed."""
    started = time.monotonic()
    try:
        result = await _in_storage_thread(
            s3pass.storage_pass, api=S3_API[0], raw=raw, job=job, caches=caches, now=clock
        )
    except k8s_exceptions.ApiException as error:
        LOG.warning("storage status of %s/%s not patched: %s", *key, error.reason)
        return None
    except Exception:
        metrics.STORAGE_ERRORS.inc()
        raise
    finally:
        metrics.STORAGE_PASS_SECONDS.observe(time.monotonic() - started)
    if result.error is not None:
        metrics.STORAGE_ERRORS.inc()
    metrics.RETENTION_DELETED.inc(len(result.deleted))
    return result


S3_LOOP = s3loop.S3Loop(run_pass=_storage_pass, settings=STORAGE, written=_Written)


def _own_pods(api: Any, job: trainingjob.TrainingJob) -> list[observe.ObservedPod]:
    """The job's own pods (``podowner``) from the API server: a pod that only
    carries the job's labels is never deleted with it."""
    name, uid = job.metadata.name, job.metadata.uid
    listed = _list_pods(api, job.metadata.namespace, name)
    return [p for p in listed if podowner.owns(p, job_name=name, job_uid=uid)]


def _delete_pods(api: Any, namespace: str, pods: list[observe.ObservedPod]) -> None:
    for pod in pods:
        # The uid precondition: a successor with the same name is not this pod.
        options = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=pod.uid))
        try:
            client.CoreV1Api(api).delete_namespaced_pod(pod.name, namespace, body=options)
        except k8s_exceptions.ApiException as error:
            if error.status not in (404, 409):
                raise


async def _pods_gone(api: Any, job: trainingjob.TrainingJob) -> None:
    """Delete the job's pods (their grace period lets the writer finish) and wait,
    bounded by that grace period plus a margin, until the API server has none."""
    bound = job.spec.checkpoint.final_checkpoint_grace_seconds + RECONCILE.pod_gone_margin_seconds
    deadline = time.monotonic() + bound
    pods = await asyncio.to_thread(_own_pods, api, job)
    if pods:
        await asyncio.to_thread(_delete_pods, api, job.metadata.namespace, pods)
    while pods and time.monotonic() < deadline:
        await asyncio.sleep(RECONCILE.pod_gone_poll_seconds)
        pods = await asyncio.to_thread(_own_pods, api, job)
    if pods:
        LOG.warning(
            "onDelete of %s/%s: pods %s still exist after %.0f s; cleaning up anyway",
            job.metadata.namespace,
            job.metadata.name,
            ",".join(p.name for p in pods),
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
        s3observe.forget_credentials(job.metadata.uid)
        return
    key = (job.metadata.namespace, job.metadata.name)
    attempt = retry + 1
    # Pods still uploading would leave orphans behind the deletion: stop them first.
    await _pods_gone(memo["api"], job)
    try:
        count = await _in_storage_thread(s3pass.cleanup, api=memo["api"], raw=raw, job=job)
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
        s3observe.forget_credentials(job.metadata.uid)
        return
    except s3observe.StoreError as failure:
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
        s3observe.forget_credentials(job.metadata.uid)
        return
    LOG.info("onDelete=Delete: removed %d objects of %s/%s from S3", count, *key)
    s3observe.forget_credentials(job.metadata.uid)


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
