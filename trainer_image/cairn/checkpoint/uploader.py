"""The upload worker: rounds of the upload backlog in their own thread, off the save path.

A save waits only for its own staging, write and commit (`pipeline.run_step`);
the committed step is handed here (`committed`), and this rank's upload
thread uploads it with the rest of the backlog (`upload_backlog.Backlog`),
however slow or hung the store is. So a brownout of S3 shows as
`UploadFailing` and a growing backlog, never as a stalled training loop.

Rounds are collective and numbered (`upload/round-<k>`): rank 0 decides when
a round runs (a new commit, the backoff of a failed round elapsed, a drain)
and which steps it tries, and broadcasts the plan; every other rank polls
for the next round's plan and uploads its own files of the same steps in the
same order. A drain (`drain`, called by every rank at the same point of the
training loop: `wait_until_finished`, `close`, the final checkpoint) asks
rank 0 for a round that ignores the backoff; a rank's drain returns once a
round carrying its drain number ran (or at its deadline).

An error that ends the worker (a fenced writer, `upload_on_failure="Fail"`,
a rank that stopped answering) is kept and raised by the manager's next call.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import threading
import time

from cairn.checkpoint import coordinator as coordinator_mod
from cairn.checkpoint import errors, layout, upload_backlog

log = logging.getLogger(__name__)

POLL_SECONDS = 0.05
"""How often a rank other than 0 looks for the next round's plan: it starts
a round at most this much after rank 0 (whose clock already runs; a small
step uploads in 1-2 s, so 0.2 s cost up to a tenth of it). One local c10d
store lookup each."""
IDLE_WAKE_SECONDS = 1.0
"""Rank 0 re-checks the backoff at least this often while idle."""

_SERVED_ALL = 2**62


@dataclasses.dataclass(kw_only=True, slots=True)
class _Counters:
    """What the worker and the training thread share (under `Uploader.cond`)."""

    commits: int = 1
    """Commits noted; starts at 1 so the first round uploads what earlier
    attempts left (the start-up backlog)."""
    commits_seen: int = 0
    drain_requested: int = 0
    drain_served: int = 0
    drain_force: bool = False
    """The pending drain retries the whole backlog, backoff or not (close)."""
    closing: bool = False
    stopped: bool = False


class Uploader:
    """One rank's upload thread over the manager's backlog."""

    def __init__(
        self,
        *,
        backlog: upload_backlog.Backlog,
        coordinator: coordinator_mod.Coordinator,
        upload_one: upload_backlog.UploadOne,
        timeout: float,
    ) -> None:
        self._backlog = backlog
        self._coord = coordinator
        self._upload_one = upload_one
        self._timeout = timeout
        self._cond = threading.Condition()
        self._state = _Counters()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # -- the training thread's side ---------------------------------------------

    def start(self) -> None:
        """Start the thread (every rank, at the same call of the training loop)."""
        if self._thread is not None:
            return
        # A daemon: a process that must exit (the final checkpoint's grace is
        # over) is not held by an upload to a hung store.
        self._thread = threading.Thread(
            target=self._main, name=f"cairn-ckpt-upload-{self._coord.rank}", daemon=True
        )
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def committed(self, step: int) -> None:
        """A step was committed on this rank (writer thread): upload it soon."""
        with self._cond:
            self._state.commits += 1
            self._cond.notify_all()

    def drain(self, *, deadline: float, force: bool = False) -> bool:
        """Collective: a round tried every step committed so far (True), or
        the deadline came first (False). `force` (rank 0 decides): retry the
        whole backlog now, backoff or not. Returns at once when never started."""
        if self._thread is None:
            return True
        with self._cond:
            self._state.drain_force = self._state.drain_force or force
            self._state.drain_requested += 1
            wanted = self._state.drain_requested
            self._cond.notify_all()
            while self._state.drain_served < wanted:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, IDLE_WAKE_SECONDS))
        return True

    def take_error(self) -> BaseException | None:
        """The error that ended the worker, once (the manager raises it)."""
        with self._cond:
            error, self._error = self._error, None
        return error

    def stop(self, *, wait: float) -> None:
        """No more rounds; wait up to `wait` seconds for the thread to end."""
        with self._cond:
            self._state.closing = True
            self._state.stopped = True
            self._cond.notify_all()
        if self._thread is not None and wait > 0:
            self._thread.join(wait)

    # -- the worker thread --------------------------------------------------------

    def _main(self) -> None:
        try:
            if self._coord.rank == 0:
                self._lead()
            else:
                self._follow()
        except BaseException as exc:
            log.warning("rank %d: the upload worker stopped: %s", self._coord.rank, exc)
            with self._cond:
                self._error = exc
        finally:
            with self._cond:
                self._state.drain_served = _SERVED_ALL
                self._cond.notify_all()

    def _lead(self) -> None:
        """Rank 0: decide each round, broadcast its plan, run it."""
        round_ = 0
        while True:
            work = self._next_work()
            if work is None:
                return
            drain, force = work
            steps = self._backlog.plan(force=force)
            if not steps and drain == 0:
                continue  # backing off, or nothing left: no round for the others
            tag = f"upload/round-{round_}"
            self._coord.broadcast(f"{tag}/plan", {"steps": steps, "drain": drain})
            round_ += 1
            self._backlog.run(tag=tag, steps=steps, upload_one=self._upload_one)
            self._served(drain)

    def _next_work(self) -> tuple[int, bool] | None:
        """Rank 0: block until a round is due: (its drain number, 0 for none;
        whether it ignores the backoff); None: stop.

        A drain ignores the backoff only for steps committed since the last
        round started (each committed step is tried at least once before a
        drain returns); otherwise it is a round like any other, possibly
        empty, which still tells every rank the drain is served."""
        with self._cond:
            state = self._state
            while True:
                if state.drain_requested > state.drain_served:
                    force = state.drain_force or state.commits > state.commits_seen
                    state.commits_seen = state.commits
                    state.drain_force = False
                    return state.drain_requested, force
                if state.stopped:
                    return None
                if not state.closing and state.commits > state.commits_seen:
                    state.commits_seen = state.commits
                    return 0, False
                next_try = self._backlog.next_try()
                now = time.monotonic()
                if not state.closing and next_try is not None and now >= next_try:
                    return 0, False
                wait = IDLE_WAKE_SECONDS if next_try is None else next_try - now
                self._cond.wait(max(0.01, min(IDLE_WAKE_SECONDS, wait)))

    def _follow(self) -> None:
        """Ranks other than 0: run every round rank 0 announces, in order."""
        round_ = 0
        while True:
            tag = f"upload/round-{round_}"
            plan = self._coord.poll(f"{tag}/plan")
            if plan is None:
                with self._cond:
                    if self._state.stopped:
                        return
                    self._cond.wait(POLL_SECONDS)
                continue
            round_ += 1
            steps = [int(s) for s in plan.get("steps", [])]
            self._backlog.run(tag=tag, steps=steps, upload_one=self._upload_one, ready=self._ready)
            self._served(int(plan.get("drain", 0)))

    def _served(self, drain: int) -> None:
        if drain:
            with self._cond:
                self._state.drain_served = max(self._state.drain_served, drain)
                self._cond.notify_all()

    def _ready(self, folder: pathlib.Path, key: str) -> None:
        """Wait (bounded) until this rank's copy of a planned step is committed:
        on node-local volumes a rank commits its folder after rank 0. Rank 0's
        verdict on the step ends the wait too: rank 0 failed it (or saw it
        gone), so this rank's copy will not be uploaded in this round anyway."""
        deadline = time.monotonic() + self._timeout
        while not layout.is_committed(folder):
            verdict = self._coord.poll(f"{key}/result")
            if verdict is not None:
                raise errors.CheckpointError(
                    f"rank 0 ended step {folder.name} of this round before rank "
                    f"{self._coord.rank}'s copy was committed: {verdict.get('error')}"
                )
            if time.monotonic() > deadline:
                raise errors.CheckpointError(
                    f"{folder} was not committed on rank {self._coord.rank} "
                    f"within {self._timeout:.0f}s"
                )
            time.sleep(POLL_SECONDS)
