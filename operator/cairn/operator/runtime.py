"""The operator's state in one process: one ``Runtime`` made at startup.

IO owner (threads, the pod cache, the shared tasks). ``handlers.configure``
builds one and keeps it in kopf's memo (``memo["runtime"]``); every handler
reaches the pod cache, the per-job kicks and locks, the finished-job queue
(``finishedjobs``) and the S3 scheduler (``s3loop``) through it, so two
operators (tests) can live in one process. Nothing here is module-global.
"""

import asyncio
import concurrent.futures
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import urllib3
from kubernetes.client import exceptions as k8s_exceptions

from cairn.api import trainingjob
from cairn.operator import (
    finishedjobs,
    kubeapi,
    metrics,
    podcache,
    reconcile,
    s3loop,
    s3observe,
    s3pass,
)
from cairn.operator.core import backoff, tunables
from cairn.operator.reconcile import Key

LOG = logging.getLogger(__name__)
_T = TypeVar("_T")
TRANSPORT_ERRORS = (urllib3.exceptions.HTTPError, ConnectionError)
"""What the Kubernetes client raises when it got no answer at all (refused or
reset connections, read timeouts of a frozen API server)."""


def client_retries() -> urllib3.Retry:
    """urllib3's retries for the operator's API clients: its defaults (3 tries of a
    refused connection or an idempotent request), but a 429/503 is not slept on
    inside the call. urllib3 would sleep the Retry-After in the worker thread, up
    to 3 times, exactly (every throttled job back at once) and with the threads
    every job's reconcile shares parked; the job's own backoff (``core.backoff``)
    honours it instead."""
    return urllib3.Retry(total=3, respect_retry_after_header=False)


class Stopped(Protocol):
    """kopf's ``DaemonStopped``: true once the daemon is told to stop."""

    def __bool__(self) -> bool: ...

    def wait(self) -> Awaitable[object]: ...


async def sleep_until(kick: asyncio.Event, stopped: Stopped, timeout: float) -> None:
    """Until kicked, stopped (the job finished or is being deleted) or ``timeout``."""
    waits = [asyncio.ensure_future(kick.wait()), asyncio.ensure_future(stopped.wait())]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()


class Runtime:
    """One operator's mutable state. ``api``: its Kubernetes calls (``kubeapi``)."""

    def __init__(
        self,
        *,
        api: kubeapi.KubeApi,
        settings: tunables.Settings = tunables.DEFAULT,
        watch_namespaces: list[str] | None = None,
    ) -> None:
        self.api = api
        self.settings = settings
        self.watch_namespaces = watch_namespaces
        """The namespaces kopf watches (``__main__``); None: every namespace."""
        self.pods = podcache.PodCache()
        """Every job's pods; ``handlers.configure`` starts the reflector that fills it."""
        self.pods_listed = asyncio.Event()
        """Set (on the loop) once the reflector's first list is in."""
        self.kicks: dict[Key, asyncio.Event] = {}
        self.locks: dict[Key, asyncio.Lock] = {}
        """One per job: a finished job's reconcile waits for its stopping daemon's."""
        self.failures: dict[Key, int] = {}
        """Per job, reconciles failed in a row (API or transport errors)."""
        self.retry_waits: dict[Key, float] = {}
        """Per job, the backoff drawn at its last failed reconcile (``retry_wait``)."""
        self.error_backoff = backoff.Policy(
            base_seconds=settings.reconcile.error_retry_seconds,
            cap_seconds=settings.reconcile.error_backoff_cap_seconds,
            jitter=settings.reconcile.error_jitter,
            retry_after_cap_seconds=settings.reconcile.retry_after_cap_seconds,
        )
        self.foreign_reported: dict[Key, frozenset[str]] = {}
        """Per job, the foreign pods (``podowner``) already reported in a ForeignPod
        Event: each once per job and pod (again after an operator restart)."""
        # S3 work runs in its own threads: a slow or unreachable store (botocore
        # retries, timeouts) never takes the threads the reconcile loops use.
        self.storage_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=settings.storage.threads, thread_name_prefix="cairn-s3"
        )
        self.finished = finishedjobs.FinishedJobs(
            reconcile=self._reconcile_finished,
            pods_ready=self.pods_ready,
            api=api,
            settings=settings.reconcile,
        )
        self.s3_loop = s3loop.S3Loop(
            run_pass=self._storage_pass, settings=settings.storage, written=reconcile.Written
        )

    def lock(self, key: Key) -> asyncio.Lock:
        return self.locks.setdefault(key, asyncio.Lock())

    def kick(self, namespace: str | None, name: str | None) -> None:
        """Wake the job's daemon, or queue a finished job (it has none)."""
        key = (namespace or "", name or "")
        event = self.kicks.get(key)
        if event is not None:
            event.set()
        else:
            self.finished.enqueue(key)

    def forget(self, key: Key) -> None:
        """The job is gone from the API server."""
        self.s3_loop.forget(key)
        self.finished.forget(key)
        self.locks.pop(key, None)
        self.foreign_reported.pop(key, None)
        self.failures.pop(key, None)
        self.retry_waits.pop(key, None)

    async def pods_ready(self, stopped: Stopped | None = None) -> None:
        """Until the pod cache holds the first full list (or the daemon is stopped)."""
        if stopped is None:
            await self.pods_listed.wait()
            return
        while not self.pods_listed.is_set() and not stopped:
            await sleep_until(self.pods_listed, stopped, self.settings.reconcile.resync_seconds)

    async def in_storage_thread(self, call: Callable[..., _T], /, *args: Any, **kwargs: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self.storage_pool, functools.partial(call, *args, **kwargs)
        )

    async def reconcile_guarded(
        self,
        key: Key,
        *,
        body: Any,
        written: reconcile.Written,
        truth: reconcile.PodTruth,
    ) -> float | None:
        """``reconcile_once`` under the job's lock; None after an API or transport
        error (logged; ``retry_wait`` says when to try again)."""
        started = time.monotonic()
        try:
            async with self.lock(key):
                wait = await reconcile.reconcile_once(
                    body=body,
                    pods=self.pods,
                    api=self.api,
                    written=written,
                    truth=truth,
                    reported=self.foreign_reported,
                    settings=self.settings.reconcile,
                )
            self.failures.pop(key, None)
            return wait
        except k8s_exceptions.ApiException as error:
            metrics.RECONCILE_ERRORS.labels(kind="api").inc()
            headers = error.headers or {}
            self._failed(
                key, what=f"{error.status} {error.reason}", retry_after=headers.get("Retry-After")
            )
            return None
        except TRANSPORT_ERRORS as error:
            metrics.RECONCILE_ERRORS.labels(kind="transport").inc()
            self._failed(key, what=type(error).__name__, retry_after=None)
            return None
        except Exception:
            metrics.RECONCILE_ERRORS.labels(kind="exception").inc()
            raise
        finally:
            metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)

    def _failed(self, key: Key, *, what: str, retry_after: str | None) -> None:
        """Count the job's failure and draw its own delay (``core.backoff``): every
        job's daemon fails at once in an API server outage, and must not return at once."""
        count = self.failures.get(key, 0) + 1
        self.failures[key] = count
        advice = backoff.parse_retry_after(retry_after, now=reconcile.clock())
        wait = backoff.delay(
            self.error_backoff, failures=count, draw=random.random(), retry_after=advice
        )
        self.retry_waits[key] = wait
        asked = "" if advice is None else f", Retry-After {advice:.0f} s"
        LOG.warning(
            "reconcile of %s/%s failed (%s%s; %d in a row): again in %.2f s",
            *key,
            what,
            asked,
            count,
            wait,
        )

    def retry_wait(self, key: Key) -> float:
        """How long the job's daemon waits after its last failed reconcile."""
        return self.retry_waits.get(key, self.settings.reconcile.error_retry_seconds)

    async def _reconcile_finished(self, key: Key, raw: dict[str, Any]) -> float | None:
        truth = reconcile.PodTruth(list_first=False)
        return await self.reconcile_guarded(key, body=raw, written=reconcile.Written(), truth=truth)

    async def _storage_pass(
        self,
        key: Key,
        raw: dict[str, Any],
        job: trainingjob.TrainingJob,
        caches: s3observe.Caches,
    ) -> s3pass.PassResult | None:
        """One S3 pass in the S3 threads, with its metrics; None if the status patch failed."""
        started = time.monotonic()
        deadline = s3observe.Deadline.after(self.settings.storage.pass_deadline_seconds)
        try:
            work = asyncio.ensure_future(
                self.in_storage_thread(
                    s3pass.storage_pass,
                    api=self.api,
                    raw=raw,
                    job=job,
                    caches=caches,
                    now=reconcile.clock,
                    deadline=deadline,
                )
            )
            # A call stuck past the deadline: say so now; the thread ends on its own
            # (every call is bounded) and keeps the job's place in s3fair meanwhile.
            if not (await asyncio.wait({work}, timeout=deadline.seconds))[0]:
                await asyncio.to_thread(s3pass.report_abandoned, api=self.api, raw=raw, at=deadline)
            result = await work
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

    def close(self) -> None:
        """Let the S3 threads go (a running pass finishes on its own)."""
        self.storage_pool.shutdown(wait=False, cancel_futures=True)
