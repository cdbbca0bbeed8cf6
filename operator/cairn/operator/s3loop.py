"""When each job's S3 pass runs: one scheduler task for every job, no task per job.

``handlers`` feeds it every TrainingJob event (``update``) and deletion
(``forget``) and runs ``run()`` as one asyncio task. It keeps, per job that
``s3plan.pass_wanted`` says needs passes, the latest body, the time of the
next pass (a heap) and the job's ``s3observe.Caches``; passes run
(``s3pass.storage_pass``) in the S3 threads, at most ``threads`` at once,
chosen by ``core.s3fair.take``: a store that is slow (or not yet seen to
answer) gets one pass at a time and all such stores together a share of the
threads, so one tenant's hung endpoint never delays the other jobs' passes.

- a live job with ``upload``: ``initial_delay_seconds`` after it is first
  seen, then every ``interval_seconds``, and ``kick_delay_seconds`` after
  the writer reports a new ``lastUploaded`` step;
- a job that finished (Succeeded, Failed): one final pass, then it leaves
  the schedule and its caches are dropped; a spec change (a new
  ``metadata.generation``) brings one more final pass. The generation the
  final pass ran for is remembered in process memory only: an operator
  restart gives each finished job one pass again (reads only; the status
  is written only if what S3 holds changed);
- a job being deleted, managed by another controller or without
  ``upload``: no pass (``onDelete`` does its own S3 work).

A pass that listed its share of a long listing (``core.s3slice``: the
result ``goes_on``) is due again at once, behind the passes already due, and
does not count as a pass; a listing that reached ``list_max_keys`` puts the
job's next pass off by ``s3slice.cap_backoff`` instead of the interval.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import dataclasses
import heapq
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from cairn.api import trainingjob
from cairn.operator import prefixindex, s3observe
from cairn.operator.core import jobobserve, s3fair, s3plan, s3slice, tunables

LOG = logging.getLogger(__name__)
Key = tuple[str, str]


class Written(Protocol):
    """``handlers._Written``: the job as our own last status patch returned it."""

    def freshest(self, live: dict[str, Any]) -> dict[str, Any]: ...

    def record(self, planned_from: dict[str, Any], patched: dict[str, Any] | None) -> None: ...


class _Unwritten:
    """Plans from the event's body as it is (for callers without ``_Written``)."""

    def freshest(self, live: dict[str, Any]) -> dict[str, Any]:
        return live

    def record(self, planned_from: dict[str, Any], patched: dict[str, Any] | None) -> None:
        del planned_from, patched


def uploaded_step(raw: Any) -> int | None:
    """``status.checkpoints.lastUploaded.step`` of a job body, or None. Pure."""
    try:
        step = raw["status"]["checkpoints"]["lastUploaded"]["step"]
    except (KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


def _has_upload(raw: Any) -> bool:
    """Whether the body names ``spec.checkpoint.upload`` at all. Pure."""
    spec = raw.get("spec") if isinstance(raw, dict) else None
    checkpoint = spec.get("checkpoint") if isinstance(spec, dict) else None
    return isinstance(checkpoint, dict) and checkpoint.get("upload") is not None


@dataclasses.dataclass(kw_only=True, slots=True)
class _Entry:
    raw: dict[str, Any]
    job: trainingjob.TrainingJob
    kind: s3plan.PassKind
    uploaded: int | None
    written: Written
    caches: s3observe.Caches = dataclasses.field(default_factory=s3observe.Caches)

    @property
    def endpoint(self) -> str:
        """The store the job's passes go to ("" for the default one): the unit of fairness."""
        upload = self.job.spec.checkpoint.upload
        return (upload.endpoint or "") if upload is not None else ""


Runner = Callable[[Key, dict[str, Any], trainingjob.TrainingJob, s3observe.Caches], Awaitable[Any]]
"""Runs one pass (in a worker thread) and returns ``s3pass.PassResult``."""


class S3Loop:
    """The S3 passes of every job, scheduled from one task."""

    def __init__(
        self,
        *,
        run_pass: Runner,
        settings: tunables.StorageLoop = tunables.DEFAULT.storage,
        written: Callable[[], Written] = _Unwritten,
        monotonic: Callable[[], float] = time.monotonic,
        prefixes: prefixindex.PrefixIndex = prefixindex.INDEX,
    ) -> None:
        self._run_pass = run_pass
        self._prefixes = prefixes
        """Every job's prefix, finished and deleting ones too (``nested_refusal``)."""
        self._settings = settings
        self._written = written
        self._monotonic = monotonic
        self._jobs: dict[Key, _Entry] = {}
        self._due: dict[Key, float] = {}
        self._heap: list[tuple[float, Key]] = []
        self._final_done: dict[Key, tuple[str, int]] = {}
        """(uid, generation) the last final pass of a job ran for."""
        self._running: dict[Key, s3fair.Running] = {}
        self._ended: dict[str, float] = {}
        """Per endpoint (or slow job's unit), how long its last finished pass took."""
        self._answered: dict[str, float] = {}
        """Per endpoint, when a quick pass on it last ended (``s3fair.store_is_slow``)."""
        self._slow_jobs: set[Key] = set()
        """Jobs whose last pass was slow while their store answered others: each is a
        slow unit of its own (``s3fair.job_unit``), not its store."""
        self._held = False
        """Whether the last ``due_now`` held a due pass back (fairness)."""
        self._wake = asyncio.Event()
        self.passes: collections.Counter[tuple[Key, s3plan.PassKind]] = collections.Counter()
        """Passes run so far, by job and kind (for tests and the bench)."""
        self.slices: collections.Counter[Key] = collections.Counter()
        """Passes that listed a share of a listing that goes on, by job."""

    def scheduled(self, key: Key) -> bool:
        """Whether the job has a pass to come (or one running)."""
        return key in self._jobs

    def __len__(self) -> int:
        return len(self._jobs)

    def _final_generation(self, key: Key, uid: str) -> int | None:
        done = self._final_done.get(key)
        return done[1] if done is not None and done[0] == uid else None

    def update(self, key: Key, raw: dict[str, Any]) -> None:
        """A job event: (re)schedule, or drop the job from the schedule."""
        if not _has_upload(raw):  # most jobs: no model parse on each of their events
            self._prefixes.forget(key)
            self._drop(key)
            return
        job = jobobserve.parse_job(raw)
        if isinstance(job, jobobserve.InvalidJob):
            self._prefixes.forget(key)
            self._drop(key)
            return
        self._prefixes.note(key, job, raw)
        kind = s3plan.pass_wanted(job, final_done=self._final_generation(key, job.metadata.uid))
        if kind is None:
            self._drop(key)
            return
        now = self._monotonic()
        uploaded = uploaded_step(raw)
        entry = self._jobs.get(key)
        if entry is None or entry.job.metadata.uid != job.metadata.uid:
            written = self._written()
            self._jobs[key] = _Entry(
                raw=raw, job=job, kind=kind, uploaded=uploaded, written=written
            )
            self._schedule(key, now + self._settings.initial_delay_seconds)
            return
        kicked = uploaded is not None and uploaded != entry.uploaded
        finished = kind == "final" and entry.kind != "final"
        entry.raw, entry.job, entry.kind, entry.uploaded = raw, job, kind, uploaded
        if kicked or finished:
            self._schedule(key, now + self._settings.kick_delay_seconds)

    def forget(self, key: Key) -> None:
        """The job is gone: no pass, no memory of it."""
        self._prefixes.forget(key)
        self._drop(key)
        self._final_done.pop(key, None)

    def _drop(self, key: Key) -> None:
        entry = self._jobs.pop(key, None)
        self._due.pop(key, None)
        if key in self._slow_jobs and entry is not None:
            self._slow_jobs.discard(key)
            self._ended.pop(s3fair.job_unit(entry.endpoint, "/".join(key)), None)

    def _schedule(self, key: Key, at: float) -> None:
        """The next pass of ``key`` at ``at`` at the latest (an earlier one stays)."""
        if key in self._due and self._due[key] <= at:
            return
        self._due[key] = at
        heapq.heappush(self._heap, (at, key))
        self._wake.set()

    def due_now(self) -> list[Key]:
        """Take the jobs whose pass is due, as many as free threads and the
        endpoints' fairness (``s3fair.take``) allow; the rest stay due."""
        now = self._monotonic()
        due: list[tuple[float, Key]] = []
        while self._heap and self._heap[0][0] <= now:
            at, key = heapq.heappop(self._heap)
            if self._due.get(key) == at:  # else superseded by an earlier schedule, or dropped
                due.append((at, key))
        ready = [
            (key, self._unit(key, self._jobs[key])) for _, key in due if key not in self._running
        ]
        taken = s3fair.take(
            ready,
            ended=self._ended,
            running=list(self._running.values()),
            now=now,
            threads=self._settings.threads,
            share=self._settings.slow_share,
            slow_after=self._settings.slow_after_seconds,
            answered=self._answered,
        )
        chosen = set(taken)
        for at, key in due:
            if key in chosen:
                del self._due[key]
            else:
                heapq.heappush(self._heap, (at, key))  # after a running pass ends
        self._held = len(taken) < len(due)
        return taken

    def _unit(self, key: Key, entry: _Entry) -> str:
        """What ``s3fair`` judges the job's pass by: its store, or itself when slow."""
        if key in self._slow_jobs:
            return s3fair.job_unit(entry.endpoint, "/".join(key))
        return entry.endpoint

    def _start(self, key: Key) -> None:
        entry = self._jobs.get(key)
        unit = self._unit(key, entry) if entry is not None else ""
        self._running[key] = s3fair.Running(endpoint=unit, started=self._monotonic())

    def _ended_pass(self, key: Key, entry: _Entry | None, running: s3fair.Running) -> None:
        """Charge a finished pass's time to its store, or to the job when the store
        answered other passes meanwhile (a tenant's own slow prefix)."""
        took = self._monotonic() - running.started
        store = entry.endpoint if entry is not None else running.endpoint
        slow_after = self._settings.slow_after_seconds
        if took < slow_after:
            self._slow_jobs.discard(key)
            self._ended.pop(s3fair.job_unit(store, "/".join(key)), None)
            self._answered[store] = self._monotonic()
            self._ended[store] = took
        elif s3fair.store_is_slow(
            started=running.started,
            took=took,
            answered=self._answered,
            endpoint=store,
            slow_after=slow_after,
        ):
            self._ended[store] = took
        else:
            self._slow_jobs.add(key)
            self._ended[s3fair.job_unit(store, "/".join(key))] = took

    def _next_wake(self) -> float | None:
        """Seconds to the next due pass; None: only a pass ending (or an update) helps."""
        if not self._heap or len(self._running) >= self._settings.threads:
            return None
        now = self._monotonic()
        if not self._held:
            return max(0.0, self._heap[0][0] - now)
        # Held-back passes wait for a running pass to end (it sets the wake).
        later = [at for at, _ in self._heap if at > now]
        return min(later) - now if later else None

    async def run_due(self) -> list[Key]:
        """Run the passes due now and wait for them; the jobs passed (``run`` does
        the same without waiting; tests drive the schedule with this)."""
        taken = self.due_now()
        for key in taken:
            self._start(key)
        await asyncio.gather(*(self._one(key) for key in taken))
        return taken

    async def run(self) -> None:
        """Run due passes forever (cancel the task to stop)."""
        tasks: set[asyncio.Task[None]] = set()
        while True:
            for key in self.due_now():
                self._start(key)
                task = asyncio.create_task(self._one(key))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            self._wake.clear()
            timeout = self._next_wake()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=timeout)

    async def _one(self, key: Key) -> None:
        entry = self._jobs.get(key)
        generation = entry.job.metadata.generation if entry else 0
        kind = entry.kind if entry else None
        result: Any = None
        try:
            if entry is not None and kind is not None:
                raw = entry.written.freshest(copy.deepcopy(entry.raw))
                result = await self._run_pass(key, raw, entry.job, entry.caches)
                entry.written.record(raw, getattr(result, "patched_object", None))
                if getattr(result, "goes_on", False):
                    self.slices[key] += 1
                else:
                    self.passes[(key, kind)] += 1
        except Exception:  # keep the loop alive; the next pass tries again
            LOG.exception("S3 pass of %s/%s failed", *key)
        finally:
            running = self._running.pop(key, None)
            if running is not None:
                self._ended_pass(key, entry, running)
            if entry is not None and kind is not None:
                self._after(key, entry, kind=kind, generation=generation, result=result)
            self._wake.set()

    def _after(
        self, key: Key, entry: _Entry, *, kind: s3plan.PassKind, generation: int, result: Any
    ) -> None:
        """Reschedule after a pass: a live job in an interval (or its back-off), a
        finished one not again; a listing that goes on at once."""
        if self._jobs.get(key) is not entry:
            return  # deleted or replaced meanwhile
        now = self._monotonic()
        if getattr(result, "goes_on", False):
            self._schedule(key, now)  # behind the passes already due
            return
        if kind == "final":
            self._final_done[key] = (entry.job.metadata.uid, generation)
        wanted = s3plan.pass_wanted(
            entry.job, final_done=self._final_generation(key, entry.job.metadata.uid)
        )
        if wanted is None:
            self._drop(key)
        elif wanted == "final" and kind == "final":
            # The spec changed while the pass ran: one more final pass.
            self._schedule(key, now + self._settings.kick_delay_seconds)
        else:
            entry.kind = wanted
            self._schedule(key, now + self._next_interval(result))

    def _next_interval(self, result: Any) -> float:
        """The interval, or longer after listings that reached ``list_max_keys``."""
        capped = getattr(result, "capped", 0)
        if not isinstance(capped, int) or capped < 1:
            return self._settings.interval_seconds
        wait = s3slice.cap_backoff(
            capped=capped,
            base_seconds=self._settings.list_cap_backoff_seconds,
            cap_seconds=self._settings.list_cap_backoff_cap_seconds,
            draw=random.random(),
        )
        return max(self._settings.interval_seconds, wait)
