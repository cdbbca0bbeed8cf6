"""kopf wiring: one serialized reconcile loop per live TrainingJob.

The only module (with ``__main__``) that imports kopf; everything it does
goes through one ``runtime.Runtime`` made at startup (``configure``) and kept
in kopf's memo. Each TrainingJob that is not Succeeded or Failed gets a
daemon (kopf ``when=`` filter) that runs ``reconcile.reconcile_once``
(observe -> ``core.jobplan.plan()`` -> ``jobapply.apply()``) and then sleeps
until something kicks it (a change of the job, a change of one of its pods,
its Kueue Workload) or until the plan's ``requeue_after`` (at most
``tunables.Reconcile.resync_seconds``); after a failed reconcile (an API or
transport error) it sleeps the job's own jittered backoff instead
(``Runtime.retry_wait``, ``core.backoff``), kicks or not. One daemon per
job means reconciles of a job never overlap. A job that finished loses its daemon (kopf stops it
when the filter turns false); what is left to do for it is one reconcile
from one shared task (``finishedjobs.FinishedJobs``) whenever the job or one
of its pods changes. Pods are not watched by kopf: one reflector of the
operator's own (``podcache``: list, watch, re-list after 410 Gone) keeps
every job's pods reduced to ``jobobserve.ObservedPod`` and kicks a job when
what its plan sees of them changed. No reconcile runs before that first
list is in.

The S3 pass (``s3pass.storage_pass``: verification, remote retention,
``status.storage``) of every job runs from one scheduler task
(``s3loop.S3Loop``). The deletion handler applies ``onDelete: Delete``
(``ondelete``) before kopf releases the finalizer, bounded.

Run: ``kopf run -m cairn.operator.handlers --all-namespaces`` (or
``python -m cairn.operator``, which adds leader election and metrics).
"""

import asyncio
import concurrent.futures
import copy
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes import client, config
from kubernetes.config import config_exception

from cairn.api import jobstatus, trainingjob
from cairn.operator import kubeapi, metrics, ondelete, podcache, reconcile, runtime
from cairn.operator.core import kueueplan, names, tunables

FINALIZER = "cairn.dev/finalizer"
RECONCILE = tunables.DEFAULT.reconcile


def finished(raw: Mapping[str, Any]) -> bool:
    """Whether the job is Succeeded or Failed (its status says so). Pure."""
    status = raw.get("status")
    return isinstance(status, Mapping) and status.get("phase") in jobstatus.TERMINAL_PHASES


def _runtime(memo: kopf.Memo) -> runtime.Runtime:
    made: runtime.Runtime = memo["runtime"]
    return made


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
    configuration.retries = runtime.client_retries()
    state = runtime.Runtime(
        api=kubeapi.KubeApi.of(
            kubeapi.BoundedApiClient(
                configuration,
                connect_seconds=RECONCILE.api_connect_timeout_seconds,
                read_seconds=RECONCILE.api_read_timeout_seconds,
            )
        ),
        watch_namespaces=memo.get("watch_namespaces"),
    )
    memo["runtime"] = state
    memo["api"] = state.api
    # Every job's blocking API calls (asyncio.to_thread) share the loop's default
    # executor; its default size (cores + 4) queues a burst of reconciles behind
    # each other, though they mostly wait on the API server.
    asyncio.get_running_loop().set_default_executor(
        concurrent.futures.ThreadPoolExecutor(
            max_workers=RECONCILE.api_threads, thread_name_prefix="cairn-api"
        )
    )
    memo["tasks"] = [
        asyncio.create_task(state.s3_loop.run(), name="cairn S3 passes"),
        asyncio.create_task(state.finished.run(), name="cairn finished jobs"),
    ]
    loop = asyncio.get_running_loop()

    def changed(key: reconcile.Key) -> None:  # from the reflector's thread
        loop.call_soon_threadsafe(state.kick, *key)

    def ready() -> None:
        loop.call_soon_threadsafe(state.pods_listed.set)

    state.pods.on_change = changed
    # Its own client: the watch holds a connection for minutes at a time.
    memo["pods_stop"] = podcache.start(
        api=client.ApiClient(configuration),
        cache=state.pods,
        namespaces=state.watch_namespaces,
        on_ready=ready,
    )


@kopf.on.cleanup()
async def stop_shared_tasks(memo: kopf.Memo, **_: Any) -> None:
    for task in memo.get("tasks", ()):
        task.cancel()
    if "pods_stop" in memo:
        memo["pods_stop"].set()
    if "runtime" in memo:
        _runtime(memo).close()


@kopf.on.event(
    kueueplan.GROUP, kueueplan.VERSION, kueueplan.PLURAL, labels={names.LABEL_JOB: kopf.PRESENT}
)
async def workload_changed(
    namespace: str | None, body: kopf.Body, memo: kopf.Memo, **_: Any
) -> None:
    """A queued job's Workload changed (admitted, evicted...): reconcile its owner."""
    for owner in body.get("metadata", {}).get("ownerReferences") or ():
        if owner.get("kind") == trainingjob.KIND and owner.get("controller"):
            _runtime(memo).kick(namespace, owner.get("name"))


@kopf.on.event(trainingjob.GROUP, trainingjob.VERSION, trainingjob.PLURAL)
async def job_changed(
    namespace: str | None,
    name: str | None,
    type: str | None,
    body: kopf.Body,
    memo: kopf.Memo,
    **kwargs: Any,
) -> None:
    state = _runtime(memo)
    key = (namespace or "", name or "")
    if type == "DELETED":
        metrics.JOBS.forget(*key)
        state.forget(key)
        return
    metrics.JOBS.observe(*key, body)
    raw = copy.deepcopy(dict(body))
    state.s3_loop.update(key, raw)
    if finished(raw):
        state.finished.note(key, raw)
    else:
        state.finished.forget(key)
        state.kick(namespace, name)


def _live(body: kopf.Body, **_: Any) -> bool:
    """The reconcile daemon's kopf filter: only a job that did not finish has one."""
    return not finished(body)


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
    state = _runtime(memo)
    key = (namespace or "", name)
    kick = state.kicks.setdefault(key, asyncio.Event())
    written = reconcile.Written()
    # The first reconcile (on an operator start, for every job at once) plans
    # from the pod cache's first full list, never from a half-filled cache.
    await state.pods_ready(stopped)
    truth = reconcile.PodTruth(list_first=False)
    try:
        while not stopped:
            kick.clear()
            wait = await state.reconcile_guarded(key, body=body, written=written, truth=truth)
            if wait is None:  # an API/transport error: the job's own backoff, not kicks
                await runtime.sleep_until(asyncio.Event(), stopped, state.retry_wait(key))
            else:
                await runtime.sleep_until(kick, stopped, wait)
    finally:
        if state.kicks.get(key) is kick:
            state.kicks.pop(key, None)


@kopf.on.delete(trainingjob.GROUP, trainingjob.VERSION, trainingjob.PLURAL)
async def on_delete(*, body: kopf.Body, memo: kopf.Memo, retry: int, **_: Any) -> None:
    """``onDelete: Delete``: empty the job's S3 prefix before the finalizer goes
    (``ondelete.clean_up``; a failed attempt is retried by kopf with a delay)."""
    state = _runtime(memo)
    try:
        await ondelete.clean_up(
            raw=copy.deepcopy(dict(body)),
            api=state.api,
            retry=retry,
            in_storage_thread=state.in_storage_thread,
            settings=state.settings,
        )
    except ondelete.RetryLaterError as later:
        raise kopf.TemporaryError(str(later), delay=later.delay) from None
