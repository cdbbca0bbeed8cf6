"""Every job's pods, from one list + watch of the operator's own (not kopf's).

Why not kopf's pod watch and index: kopf keeps a worker task and a memory per
watched object, and for an index a readiness toggle per object too; every
toggle made or dropped wakes every worker waiting for the operator to be
indexed, so its start-up is quadratic in the number of objects. With 2,000
TrainingJobs (4,000 pods) a restarted operator had not reconciled a single
job after 10 minutes. This reflector does what client-go's informer does: a
paginated LIST (server-side label selector ``cairn.dev/job-name``), then a
WATCH from the list's resourceVersion, resumed from the last one it saw
(bookmarks included), and a fresh LIST that replaces everything it knew
when the server answers 410 Gone. A pod deleted while the watch was away is
therefore dropped by that re-list (kopf's cache kept such pods for good).

Per pod only ``jobobserve.ObservedPod`` is kept, never the body. A job is
notified (``on_change``) only when what the plan sees of its pods changed,
not on every pod event (the kubelet's status patches mostly change nothing
the plan reads). Reads (``get``) come from the event loop, writes from the
reflector's thread; a lock keeps them apart.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from kubernetes import client
from kubernetes.watch import watch as k8s_watch

from cairn.operator.core import jobobserve, names

LOG = logging.getLogger(__name__)
Key = tuple[str, str]
"""(namespace, job name)."""

LIST_PAGE = 500
WATCH_SECONDS = 300
"""The server ends each watch after this long; it is resumed from the last version."""
RETRY_SECONDS = (1.0, 2.0, 5.0, 10.0)


class GoneError(Exception):
    """The watch's resourceVersion is older than the server keeps (410): re-list."""


class PodCache:
    """The pods of every job, reduced to ``jobobserve.ObservedPod``, keyed by job."""

    def __init__(self, on_change: Callable[[Key], None] = lambda key: None) -> None:
        self._lock = threading.Lock()
        self._by_job: dict[Key, dict[str, jobobserve.ObservedPod]] = {}
        self._job_of: dict[str, Key] = {}  # pod uid -> job: a DELETED event or a relabel
        self.on_change = on_change
        """Called (from the reflector's thread) with each job whose pods changed."""

    def get(
        self, key: Key, default: Iterable[jobobserve.ObservedPod] = ()
    ) -> Iterable[jobobserve.ObservedPod]:
        """The job's pods (as ``kopf.Index.get`` would give them)."""
        with self._lock:
            pods = self._by_job.get(key)
            return tuple(pods.values()) if pods else default

    def __len__(self) -> int:
        with self._lock:
            return len(self._job_of)

    def replace(self, namespace: str | None, bodies: Iterable[Mapping[str, Any]]) -> None:
        """A full list of ``namespace`` (None: every namespace) replaces what was known there."""
        fresh: dict[Key, dict[str, jobobserve.ObservedPod]] = {}
        for body in bodies:
            parsed = _parse(body)
            if parsed is not None:
                key, pod = parsed
                fresh.setdefault(key, {})[pod.uid] = pod
        with self._lock:
            stale = [k for k in self._by_job if namespace is None or k[0] == namespace]
            changed = {k for k in stale if self._by_job[k] != fresh.get(k)}
            changed |= {k for k in fresh if self._by_job.get(k) != fresh[k]}
            for key in stale:
                for uid in self._by_job.pop(key):
                    self._job_of.pop(uid, None)
            for key, pods in fresh.items():
                self._by_job[key] = pods
                for uid in pods:
                    self._job_of[uid] = key
        for key in changed:
            self.on_change(key)

    def apply(self, kind: str, body: Mapping[str, Any]) -> None:
        """One watch event (ADDED, MODIFIED, DELETED) of one pod."""
        uid = str((body.get("metadata") or {}).get("uid", ""))
        parsed = None if kind == "DELETED" else _parse(body)
        changed: set[Key] = set()
        with self._lock:
            was = self._job_of.pop(uid, None)
            if was is not None:
                pods = self._by_job.get(was, {})
                old = pods.pop(uid, None)
                if not pods:
                    self._by_job.pop(was, None)
                if parsed is None or parsed[0] != was or parsed[1] != old:
                    changed.add(was)
            if parsed is not None:
                key, pod = parsed
                self._by_job.setdefault(key, {})[uid] = pod
                self._job_of[uid] = key
                if key != was or pod != old:
                    changed.add(key)
        for key in changed:
            self.on_change(key)


def _parse(body: Mapping[str, Any]) -> tuple[Key, jobobserve.ObservedPod] | None:
    metadata = body.get("metadata") or {}
    job = (metadata.get("labels") or {}).get(names.LABEL_JOB)
    pod = jobobserve.parse_pod(body)
    if not job or pod is None:
        return None
    return (str(metadata.get("namespace", "")), str(job)), pod


class Reflector:
    """Keeps a ``PodCache`` in step with the API server for one namespace (or all)."""

    def __init__(
        self,
        *,
        api: client.ApiClient,
        cache: PodCache,
        namespace: str | None,
        on_listed: Callable[[], None],
        stop: threading.Event,
    ) -> None:
        self._core = client.CoreV1Api(api)
        self._cache = cache
        self._namespace = namespace
        self._on_listed = on_listed
        self._stop = stop

    def run(self) -> None:
        """Until ``stop``: list, then watch; re-list after a 410; back off after errors."""
        failures = 0
        version: str | None = None
        listed = False
        while not self._stop.is_set():
            try:
                if version is None:
                    version = self._list()
                    listed = True
                    self._on_listed()
                version = self._watch(version)
                failures = 0
            except GoneError:
                LOG.info("pod watch of %s: history gone (410); re-listing", self._scope)
                version = None
            except Exception as error:
                # Whatever broke (an API error, a dropped connection, a torn JSON
                # line), the thread must live on: every job's pods come through it.
                delay = RETRY_SECONDS[min(failures, len(RETRY_SECONDS) - 1)]
                failures += 1
                LOG.warning(
                    "pod %s of %s failed (%s); again in %.0f s%s",
                    "list" if version is None else "watch",
                    self._scope,
                    error,
                    delay,
                    # A start-up that cannot list pods (RBAC, say) must say what it blocks.
                    "; no job is reconciled before the first list" if not listed else "",
                )
                self._stop.wait(delay)

    @property
    def _scope(self) -> str:
        return self._namespace or "every namespace"

    def _call(self, **kwargs: Any) -> Any:
        kwargs.update(label_selector=names.LABEL_JOB, _preload_content=False)
        if self._namespace is None:
            return self._core.list_pod_for_all_namespaces(**kwargs)
        return self._core.list_namespaced_pod(self._namespace, **kwargs)

    def _list(self) -> str:
        """Every labelled pod (paginated) into the cache; the list's resourceVersion."""
        version = ""

        def bodies() -> Iterator[dict[str, Any]]:
            # Page by page: the cache keeps each pod reduced, so only one page of
            # bodies (not 4,000 of them at 2,000 jobs) is ever decoded at once.
            nonlocal version
            token: str | None = None
            while True:
                page = json.loads(self._call(limit=LIST_PAGE, _continue=token).data)
                yield from page.get("items") or ()
                metadata = page.get("metadata") or {}
                token = metadata.get("continue") or None
                if token is None:
                    version = str(metadata.get("resourceVersion", ""))
                    return

        self._cache.replace(self._namespace, bodies())
        return version

    def _watch(self, version: str) -> str:
        """Apply watch events from ``version`` until the server ends the watch; the
        last version seen. Raises ``GoneError`` when ``version`` is too old."""
        response = self._call(
            watch=True,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_SECONDS,
            _request_timeout=(30, WATCH_SECONDS + 30),
        )
        try:
            for event in _events(response):
                kind, body = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if body.get("code") == 410:
                        raise GoneError()
                    raise ValueError(f"watch error: {body.get('message')}")
                version = str((body.get("metadata") or {}).get("resourceVersion") or version)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._cache.apply(kind, body)
                if self._stop.is_set():
                    break
        finally:
            response.release_conn()
        return version


def _events(response: Any) -> Iterator[dict[str, Any]]:
    for line in k8s_watch.iter_resp_lines(response):
        yield json.loads(line)


def start(
    *,
    api: client.ApiClient,
    cache: PodCache,
    namespaces: Iterable[str] | None,
    on_ready: Callable[[], None],
) -> threading.Event:
    """One reflector thread per namespace (one for all when None); ``on_ready`` once
    every one listed. Returns the event that stops them."""
    scopes: list[str | None] = list(namespaces) if namespaces is not None else [None]
    stop = threading.Event()
    pending = set(range(len(scopes)))
    lock = threading.Lock()
    started = time.monotonic()

    def listed(index: int) -> None:
        with lock:
            if index not in pending:
                return
            pending.discard(index)
            if pending:
                return
        LOG.info("pods of every job listed: %d in %.1f s", len(cache), time.monotonic() - started)
        on_ready()

    for index, scope in enumerate(scopes):
        reflector = Reflector(
            api=api,
            cache=cache,
            namespace=scope,
            on_listed=lambda index=index: listed(index),  # type: ignore[misc]
            stop=stop,
        )
        threading.Thread(
            target=reflector.run, name=f"cairn-pods-{scope or 'all'}", daemon=True
        ).start()
    return stop
