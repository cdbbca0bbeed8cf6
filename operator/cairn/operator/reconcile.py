"""One job's reconcile cycle: observe -> plan -> apply, and what it keeps between cycles.

IO (the API server through ``jobapply`` and ``kueueapply``; a pod list by
label selector). ``reconcile_once`` reads the job's pods from the pod cache
(``podcache``), or from the API server after a delete found a pod already
gone (``PodTruth``), reads a queued job's Kueue Workload, asks the pure
``core.jobplan.plan`` what to do and applies it with ``jobapply.apply``.
Between cycles a job keeps the body its own last status patch returned
(``Written``: a transition is never decided twice) and the pods its last
apply created (``PodTruth`` expectations). ``handlers`` runs it from a
per-job daemon; ``finishedjobs`` runs it for finished jobs.
"""

import asyncio
import copy
import datetime
import json
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from typing import Any

from cairn.operator import jobapply, kubeapi, kueueapply, podcache, policycheck
from cairn.operator.core import jobobserve, jobplan, kueueplan, names, policygate, tunables

LOG = logging.getLogger(__name__)
Key = tuple[str, str]
"""A job: (namespace, name)."""


def clock() -> datetime.datetime:
    """The operator's clock; plan() gets time only through here."""
    return datetime.datetime.now(datetime.UTC)


class Written:
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


class PodTruth:
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
        self.create_errors: tuple[jobobserve.CreateError, ...] = ()
        self.expected: frozenset[str] = frozenset()
        self.expected_until = 0.0

    def expect(self, created: Iterable[str], *, until: float) -> None:
        """Pods (by name) the last apply created; awaited until ``until``."""
        self.expected, self.expected_until = frozenset(created), until

    def awaited(self, current: tuple[jobobserve.ObservedPod, ...], *, now: float) -> frozenset[str]:
        """The created pods the index does not show yet, while they are awaited."""
        if now >= self.expected_until:
            self.expected = frozenset()
        missing = self.expected - {p.name for p in current}
        if not missing:
            self.expected = frozenset()
        return missing

    def from_list(
        self,
        *,
        cached: tuple[jobobserve.ObservedPod, ...],
        listed: tuple[jobobserve.ObservedPod, ...],
    ) -> tuple[jobobserve.ObservedPod, ...]:
        present = {p.uid for p in listed}
        self.ghosts = {p.uid for p in cached if p.uid not in present}
        self.list_next = False
        return listed

    def from_cache(
        self, cached: tuple[jobobserve.ObservedPod, ...]
    ) -> tuple[jobobserve.ObservedPod, ...]:
        self.ghosts &= {p.uid for p in cached}  # forget those kopf dropped by now
        return tuple(p for p in cached if p.uid not in self.ghosts)


def list_pods(
    api: kubeapi.KubeApi, namespace: str, name: str
) -> tuple[jobobserve.ObservedPod, ...]:
    """The job's pods straight from the API server (not the watch cache)."""
    # The JSON as sent: decoding into V1Pod objects and back would cost more
    # CPU than the request (every job lists on each resync).
    response = api.core.list_namespaced_pod(
        namespace, label_selector=f"{names.LABEL_JOB}={name}", _preload_content=False
    )
    items = json.loads(response.data).get("items") or []
    parsed = (jobobserve.parse_pod(item) for item in items)
    return tuple(p for p in parsed if p is not None)


async def _observe_pods(
    *, truth: PodTruth, cached: tuple[jobobserve.ObservedPod, ...], api: kubeapi.KubeApi, key: Key
) -> tuple[jobobserve.ObservedPod, ...] | None:
    """The pods to plan from; None while pods the last apply created are awaited."""
    if not truth.list_next:
        current = truth.from_cache(cached)
        return None if truth.awaited(current, now=time.monotonic()) else current
    listed = await asyncio.to_thread(list_pods, api, *key)
    known = set(truth.ghosts)
    current = truth.from_list(cached=cached, listed=listed)
    if truth.ghosts - known:  # once per ghost: kopf may keep it forever
        LOG.info(
            "%s/%s: %d pod(s) in the watch cache are gone from the API; planning without them",
            *key,
            len(truth.ghosts),
        )
    truth.expected = frozenset()  # the list is the truth
    return current


async def _apply(
    *,
    api: kubeapi.KubeApi,
    raw: dict[str, Any],
    todo: jobplan.Plan,
    written: Written,
    truth: PodTruth,
    settings: tunables.Reconcile,
) -> None:
    """Apply a non-empty plan; remember what it wrote, created and found gone."""
    result = await asyncio.to_thread(
        jobapply.apply, api=api, job=jobapply.JobRef.of(raw), todo=todo, now=clock
    )
    written.record(raw, result.patched_object)
    truth.create_errors = result.create_errors
    pods_created = (c.split("/", 1)[1] for c in result.created if c.startswith("Pod/"))
    truth.expect(pods_created, until=time.monotonic() + settings.expectation_seconds)
    if result.gone:
        truth.list_next = True
    meta = raw.get("metadata", {})
    LOG.info(
        "reconciled %s/%s phase=%s created=%s deleted=%s",
        meta.get("namespace", ""),
        meta.get("name", ""),
        todo.decision.phase if todo.decision else "?",
        ",".join(result.created) or "-",
        ",".join(result.deleted) or "-",
    )


async def reconcile_once(
    *,
    body: Mapping[str, Any],
    pods: podcache.PodCache,
    api: kubeapi.KubeApi,
    written: Written,
    truth: PodTruth | None = None,
    reported: MutableMapping[Key, frozenset[str]] | None = None,
    settings: tunables.Reconcile = tunables.DEFAULT.reconcile,
    policy: policycheck.StatusPolicyCheck = policycheck.SHARED,
) -> float:
    """One observe -> plan -> apply cycle; returns how long to sleep.

    ``reported``: per job, the foreign pods already reported in an Event
    (``podowner``), kept across cycles by the caller.
    """
    truth = truth or PodTruth()
    reported = reported if reported is not None else {}
    raw = written.freshest(copy.deepcopy(dict(body)))
    meta = raw.get("metadata", {})
    key = (meta.get("namespace", ""), meta.get("name", ""))
    job = jobobserve.parse_job(raw)
    cached = tuple(pods.get(key, ()))
    current = await _observe_pods(truth=truth, cached=cached, api=api, key=key)
    if current is None:
        return max(truth.expected_until - time.monotonic(), settings.min_requeue_seconds)
    # Kueue (only for jobs labelled kueue.x-k8s.io/queue-name): the Workload gates the plan.
    queue = None
    if not isinstance(job, jobobserve.InvalidJob) and kueueplan.queue_name(job) is not None:
        # Only a queued job's reconcile waits for a worker thread here: the
        # threads are shared by every job's API calls.
        queue = await asyncio.to_thread(kueueapply.read, api, job)
    observed = jobobserve.Observed(
        pods=tuple(sorted(current, key=lambda p: (p.attempt, p.rank))),
        create_errors=truth.create_errors,
        queue=queue,
        reported_foreign=reported.get(key, frozenset()),
    )
    todo = jobplan.plan(job=job, observed=observed, now=clock())
    if todo.creates and not isinstance(job, jobobserve.InvalidJob):
        # No status Role, binding or pod without the status policy (cached check).
        missing = await asyncio.to_thread(policy.missing, api)
        todo = policygate.gate(
            todo, missing=missing, job=job, reported_before=observed.reported_foreign, now=clock()
        )
    if not todo.empty:
        await _apply(api=api, raw=raw, todo=todo, written=written, truth=truth, settings=settings)
    # After the apply (its events posted), or none was needed: never before.
    if todo.foreign_reported:
        reported[key] = todo.foreign_reported
    else:
        reported.pop(key, None)
    wait = todo.requeue_after if todo.requeue_after is not None else resync_wait(settings)
    if queue is not None:
        again = await asyncio.to_thread(
            kueueapply.sync, api, raw=raw, job=job, queue=queue, decision=todo.decision, now=clock()
        )
        wait = min(wait, again) if again is not None else wait
    return min(max(wait, settings.min_requeue_seconds), settings.resync_seconds)


def resync_wait(
    settings: tunables.Reconcile = tunables.DEFAULT.reconcile,
    draw: Callable[[], float] = random.random,
) -> float:
    """The sleep before a resync: ``resync_seconds`` shortened by up to
    ``resync_jitter`` at random, so that jobs seen at the same moment (an
    operator start) spread their reconciles over the interval."""
    return settings.resync_seconds * (1.0 - settings.resync_jitter * draw())
