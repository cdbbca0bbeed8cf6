"""Succeeded and Failed jobs: one shared queue instead of a daemon per job.

IO (through the reconcile it is given, and the TTL deletion). What is left
to do for a finished job (stop its pods, ``cleanup.finishedPods``, its Kueue
Workload) is one reconcile, planned from the pod cache, each time the job or
one of its pods changes, one job at a time; a job with
``ttlSecondsAfterFinished`` gets a timer (an asyncio ``TimerHandle``, not a
task) that posts ``TTLExpired`` and deletes it when due (``core.ttl``
decides when). Only the last body of each finished job is kept.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from kubernetes.client import exceptions as k8s_exceptions

from cairn.api import trainingjob
from cairn.operator import jobapply, kubeapi
from cairn.operator.core import k8stypes, ttl, tunables
from cairn.operator.reconcile import Key, clock

LOG = logging.getLogger(__name__)
Reconcile = Callable[[Key, dict[str, Any]], Awaitable[float | None]]
"""One reconcile of a finished job; None after an API error."""


class FinishedJobs:
    """The finished jobs' queue and TTL timers; ``run`` is its one task."""

    def __init__(
        self,
        *,
        reconcile: Reconcile,
        pods_ready: Callable[[], Awaitable[None]],
        api: kubeapi.KubeApi,
        settings: tunables.Reconcile = tunables.DEFAULT.reconcile,
    ) -> None:
        self.bodies: dict[Key, dict[str, Any]] = {}
        self._pending: dict[Key, None] = {}  # insertion-ordered set
        self._expired: dict[Key, None] = {}
        self._timers: dict[Key, asyncio.TimerHandle] = {}
        self._wake = asyncio.Event()
        self._reconcile_job = reconcile
        self._pods_ready = pods_ready
        self._api = api
        self._settings = settings
        self.reconciles = 0

    def note(self, key: Key, raw: dict[str, Any]) -> None:
        self.bodies[key] = raw
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
        await self._pods_ready()
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
        self.reconciles += 1
        if await self._reconcile_job(key, raw) is None:  # an API error: again later
            loop = asyncio.get_running_loop()
            loop.call_later(self._settings.error_retry_seconds, self.enqueue, key)

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
            await asyncio.to_thread(delete_expired, self._api, raw)
        except k8s_exceptions.ApiException as error:
            LOG.warning("TTL deletion of %s/%s failed: %s", *key, error.reason)
            self._set_timer(key, self._settings.error_retry_seconds)


def delete_expired(api: kubeapi.KubeApi, raw: dict[str, Any]) -> None:
    """Post ``TTLExpired`` and delete the job (background propagation)."""
    ref = jobapply.JobRef.of(raw)
    event = k8stypes.Event(type="Normal", reason=ttl.EVENT_REASON, message=ttl.message(raw))
    jobapply.post_event(api, ref, event, now=clock())
    try:
        api.custom.delete_namespaced_custom_object(
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
