"""kopf handlers: one serialized reconcile loop per TrainingJob.

The only module that imports kopf. Each TrainingJob gets a daemon that runs
``observe -> plan.plan() -> effects.apply()`` and then sleeps until something
kicks it (a change of the job, a change of one of its pods) or until the
plan's ``requeue_after`` (at most ``RESYNC_SECONDS``). One daemon per job
means reconciles of a job never overlap. Pods are watched once, for every
job, through the ``cairn.dev/job-name`` label and kept in a kopf index
already reduced to ``observe.ObservedPod``.

Run: ``kopf run -m cairn.operator.handlers --all-namespaces``.
"""

import asyncio
import contextlib
import copy
import datetime
import logging
from typing import Any

import kopf
from kubernetes import client, config
from kubernetes.client import exceptions as k8s_exceptions
from kubernetes.config import config_exception

from cairn.api import trainingjob
from cairn.operator import effects, names, observe, plan

LOG = logging.getLogger(__name__)
RESYNC_SECONDS = 60.0
ERROR_RETRY_SECONDS = 5.0
FINALIZER = "cairn.dev/finalizer"

_kicks: dict[tuple[str, str], asyncio.Event] = {}


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


@kopf.on.event(trainingjob.GROUP, trainingjob.VERSION, trainingjob.PLURAL)
async def job_changed(namespace: str | None, name: str | None, **_: Any) -> None:
    _kick(namespace, name)


class _Written:
    """The job as our last status patch returned it, and the resourceVersion it
    replaced: while the watch still shows that old version, plan from ours, so
    a transition is never decided (and announced) twice."""

    def __init__(self) -> None:
        self.replaced: str | None = None
        self.body: dict[str, Any] | None = None

    def freshest(self, live: dict[str, Any]) -> dict[str, Any]:
        version = live.get("metadata", {}).get("resourceVersion")
        if self.body is not None and version == self.replaced:
            return self.body
        return live


async def reconcile_once(
    *,
    body: kopf.Body,
    pods: kopf.Index[tuple[str, str], observe.ObservedPod],
    api: Any,
    written: _Written,
) -> float:
    """One observe -> plan -> apply cycle; returns how long to sleep."""
    raw = written.freshest(copy.deepcopy(dict(body)))
    meta = raw.get("metadata", {})
    namespace, name = meta.get("namespace", ""), meta.get("name", "")
    job = observe.parse_job(raw)
    seen = tuple(sorted(pods.get((namespace, name), ()), key=lambda p: (p.attempt, p.rank)))
    todo = plan.plan(job=job, observed=observe.Observed(pods=seen), now=clock())
    if not todo.empty:
        ref = effects.JobRef(name=name, namespace=namespace, uid=meta.get("uid", ""))
        result = await asyncio.to_thread(effects.apply, api=api, job=ref, todo=todo, now=clock)
        if result.patched_object is not None:
            written.replaced = meta.get("resourceVersion")
            written.body = result.patched_object
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
    try:
        while not stopped:
            kick.clear()
            try:
                wait = await reconcile_once(body=body, pods=pods, api=memo["api"], written=written)
            except k8s_exceptions.ApiException as error:
                LOG.warning("reconcile of %s/%s failed: %s", *key, error.reason)
                wait = ERROR_RETRY_SECONDS
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(kick.wait(), timeout=wait)
    finally:
        _kicks.pop(key, None)
