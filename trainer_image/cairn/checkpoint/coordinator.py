"""How ranks agree during a checkpoint, without the training process group.

The commit and upload barriers, the "step finished" broadcast and the save
requests (time-based saves, preemption) go through a `Coordinator`. The
c10d-store backend uses the rendezvous TCPStore that torchrun already runs;
the Ray backend (`cairn.checkpoint.raycoordinator`) implements the same
protocol over the `CheckpointMonitor` actor and is chosen when the Ray
driver set `CAIRN_RAY_MONITOR` in the rank actor's environment. Collectives on
the training process group are never used here: an async save that issues
them while FSDP keeps training deadlocks (docs/checkpointing.md, "The lifecycle of a step").

Keys are namespaced by attempt, so a store shared across restarts never
mixes the reports of two attempts. Every wait is bounded, and a gather (or a
`wait_for` rank 0's broadcast) ends early, naming the rank, once a missing
rank's heartbeat has stopped
(`cairn.checkpoint.liveness`; started by the manager that owns the coordinator).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import threading
import time
import typing

import torch.distributed as dist

from cairn.checkpoint import errors, liveness, monitor

log = logging.getLogger(__name__)

LIVENESS_CHECK_SECONDS = 0.5
"""How often a waiting gather reads its missing ranks' heartbeats."""

FIRST_POLL_SECONDS = 0.001
MAX_POLL_SECONDS = 0.02
STORE_READS_PER_SECOND = 50_000.0
"""What every rank's first pause of a wait together asks of the store at most:
the old fixed 20 ms poll at 1,000 ranks."""


def first_poll_seconds(world_size: int) -> float:
    """A wait's first pause: 1 ms for small jobs, longer as ranks grow so that
    all of them together read the store at most `STORE_READS_PER_SECOND`
    (20 ms, the old fixed pause, from 1,000 ranks on). Pure.

    Most waits are short (the other ranks are a few milliseconds behind), and
    a restarted worker's start and restore wait about ten times: with a fixed
    20 ms pause each wait cost ~10 ms on average past its keys' arrival."""
    return min(MAX_POLL_SECONDS, max(FIRST_POLL_SECONDS, world_size / STORE_READS_PER_SECOND))


def next_poll(pause: float) -> float:
    """The pause after `pause`: doubled, at most `MAX_POLL_SECONDS` (a long wait
    reads the store 50 times a second per rank, as before). Pure."""
    return min(MAX_POLL_SECONDS, pause * 2)


BROADCASTER = 0
"""The rank whose `broadcast` the others `wait_for`: every decision one rank makes
for all (the lineage, resume plan, installed download, commit, volume init, upload
plans and verdicts) is rank 0's, so a `wait_for` checks rank 0's heartbeat."""


class Store(typing.Protocol):
    """The part of c10d's Store API used here (TCPStore, FileStore, PrefixStore)."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes: ...


class Coordinator(typing.Protocol):
    """Barriers and small messages between the ranks of one attempt."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def publish(self, key: str, value: dict[str, typing.Any]) -> None:
        """Post this rank's report for `key`."""

    def gather(self, key: str, *, timeout: float) -> list[dict[str, typing.Any]]:
        """Every rank's report for `key`, by rank; waits at most `timeout`."""

    def broadcast(self, key: str, value: dict[str, typing.Any]) -> None:
        """Post one value for `key` (rank 0's, `BROADCASTER`)."""

    def wait_for(self, key: str, *, timeout: float) -> dict[str, typing.Any]:
        """Rank 0's broadcast value of `key`; waits at most `timeout`."""

    def poll(self, key: str) -> dict[str, typing.Any] | None:
        """The broadcast value of `key` if posted, else None; never blocks."""

    def propose(self, key: str, value: dict[str, typing.Any]) -> dict[str, typing.Any]:
        """Set `key` to `value` unless set; returns the value that won."""


class StoreCoordinator:
    """Coordinator over a c10d Store (torchrun's rendezvous TCPStore)."""

    def __init__(self, store: Store, *, rank: int, world_size: int, namespace: str) -> None:
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._ns = namespace.rstrip("/")
        # TCPStore clients are not documented as thread-safe; the writer
        # thread, the training thread and the heartbeat all use this one.
        self._lock = threading.Lock()
        self._heartbeat: _Heartbeat | None = None
        self._watch = liveness.PeerWatch()

    def start_heartbeat(
        self,
        incarnation: str,
        *,
        every: float = liveness.HEARTBEAT_SECONDS,
        dead_after: float = liveness.PRESUMED_DEAD_SECONDS,
    ) -> None:
        """Beat this rank's counter under `incarnation` (the worker group: a dead
        group's counters are never read) and end gathers early on ranks whose
        counter stopped. Idempotent; `close` stops it."""
        if self._heartbeat is not None or self._world_size <= 1:
            return
        self._watch = liveness.PeerWatch(dead_after=dead_after)
        key = self._alive_key(incarnation, self._rank)

        def post(count: int) -> None:
            with self._lock:
                self._store.set(key, str(count))

        self._heartbeat = _Heartbeat(post, incarnation=incarnation, every=every)

    def close(self) -> None:
        """Stop the heartbeat (peers may then presume this rank gone)."""
        if self._heartbeat is not None:
            self._heartbeat.stop()

    def _alive_key(self, incarnation: str, rank: int) -> str:
        return self._key(f"alive/{incarnation}/{rank}")

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    def _key(self, key: str) -> str:
        return f"{self._ns}/{key}"

    def _wait(
        self, keys: list[str], timeout: float, what: str, *, ranks: list[int] | None = None
    ) -> None:
        """Until every key is set; `ranks[i]` posts `keys[i]` (liveness checked)."""
        # Poll with short waits so the lock is not held for the whole bound.
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
        next_check = time.monotonic() + LIVENESS_CHECK_SECONDS
        pause = first_poll_seconds(self._world_size)
        while True:
            with self._lock:
                if self._store.check(keys):
                    return
            if datetime.datetime.now() >= deadline:
                raise errors.CoordinationTimeoutError(
                    f"rank {self._rank}: no report for {what} within {timeout:.0f}s "
                    "(a rank died or stalled)"
                )
            beating = self._heartbeat
            if ranks is not None and beating is not None and time.monotonic() >= next_check:
                self._fail_on_dead_peers(keys, ranks, what, incarnation=beating.incarnation)
                next_check = time.monotonic() + LIVENESS_CHECK_SECONDS
            threading.Event().wait(pause)
            pause = next_poll(pause)

    def _fail_on_dead_peers(
        self, keys: list[str], ranks: list[int], what: str, *, incarnation: str
    ) -> None:
        """Raise PeerLostError if a rank that has not posted its key stopped beating."""
        with self._lock:
            missing = [r for k, r in zip(keys, ranks, strict=True) if not self._store.check([k])]
            for rank in missing:
                key = self._alive_key(incarnation, rank)
                beat = self._store.get(key).decode() if self._store.check([key]) else None
                self._watch.observe(rank, beat, time.monotonic())
        now = time.monotonic()
        dead = self._watch.presumed_dead(missing, now)
        if dead:
            silent = self._watch.silent_for(dead[0], now) or 0.0
            raise errors.PeerLostError(
                f"rank {self._rank}: no report for {what}: rank {dead[0]}'s heartbeat has "
                f"not moved for {silent:.0f}s (presumed dead"
                + (f"; also ranks {dead[1:]}" if dead[1:] else "")
                + ")"
            )

    def publish(self, key: str, value: dict[str, typing.Any]) -> None:
        with self._lock:
            self._store.set(self._key(f"{key}/{self._rank}"), json.dumps(value))

    def gather(self, key: str, *, timeout: float) -> list[dict[str, typing.Any]]:
        keys = [self._key(f"{key}/{r}") for r in range(self._world_size)]
        self._wait(keys, timeout, key, ranks=list(range(self._world_size)))
        with self._lock:
            return [json.loads(self._store.get(k)) for k in keys]

    def broadcast(self, key: str, value: dict[str, typing.Any]) -> None:
        with self._lock:
            self._store.set(self._key(key), json.dumps(value))

    def wait_for(self, key: str, *, timeout: float) -> dict[str, typing.Any]:
        # Ends early, like a gather, once the broadcaster's heartbeat stops: a
        # rank 0 SIGKILLed before its decision no longer holds every peer for
        # the whole bound.
        self._wait([self._key(key)], timeout, key, ranks=[BROADCASTER])
        with self._lock:
            result: dict[str, typing.Any] = json.loads(self._store.get(self._key(key)))
        return result

    def poll(self, key: str) -> dict[str, typing.Any] | None:
        with self._lock:
            if not self._store.check([self._key(key)]):
                return None
            result: dict[str, typing.Any] = json.loads(self._store.get(self._key(key)))
        return result

    def propose(self, key: str, value: dict[str, typing.Any]) -> dict[str, typing.Any]:
        with self._lock:
            won = self._store.compare_set(self._key(key), "", json.dumps(value))
        result: dict[str, typing.Any] = json.loads(won)
        return result


class _Heartbeat:
    """A daemon thread that moves one rank's counter every `every` seconds.

    Its own thread: a training step, a long restore or a GIL-releasing
    collective never delays a beat. A store error is logged once and the
    beat goes on trying (the store may come back; if not, peers presume this
    rank gone, which is then true of its part in the job)."""

    def __init__(
        self, post: typing.Callable[[int], None], *, incarnation: str, every: float
    ) -> None:
        self.incarnation = incarnation
        self._post = post
        self._every = every
        self._stopped = threading.Event()
        self._beats = 0
        self._warned = False
        self._beat()  # posted before the first wait can look for it
        self._thread = threading.Thread(target=self._run, name="cairn-ckpt-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._beats += 1
        try:
            self._post(self._beats)
        except Exception as exc:  # the store's failure is the waiters' to report
            if not self._warned:
                self._warned = True
                log.warning("checkpoint heartbeat: the store refused a beat (%s)", exc)

    def _run(self) -> None:
        while not self._stopped.wait(self._every):
            self._beat()

    def stop(self) -> None:
        self._stopped.set()
        # Bounded: a beat stuck in a hung store is not waited for (daemon).
        self._thread.join(timeout=2 * self._every + 1.0)


class LocalCoordinator:
    """The single-process coordinator (world size 1, no store)."""

    def __init__(self) -> None:
        self._values: dict[str, dict[str, typing.Any]] = {}

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def publish(self, key: str, value: dict[str, typing.Any]) -> None:
        self._values[f"{key}/0"] = value

    def gather(self, key: str, *, timeout: float) -> list[dict[str, typing.Any]]:
        return [self._values[f"{key}/0"]]

    def broadcast(self, key: str, value: dict[str, typing.Any]) -> None:
        self._values[key] = value

    def wait_for(self, key: str, *, timeout: float) -> dict[str, typing.Any]:
        return self._values[key]

    def poll(self, key: str) -> dict[str, typing.Any] | None:
        return self._values.get(key)

    def propose(self, key: str, value: dict[str, typing.Any]) -> dict[str, typing.Any]:
        return self._values.setdefault(key, value)


@typing.runtime_checkable
class Fencing(typing.Protocol):
    """A coordinator that is itself a commit authority (the Ray monitor: group fencing)."""

    def commit_fence(self) -> typing.Any:
        """A `cairn.checkpoint.fence.Fence` checked before each commit."""


def from_default_group(*, namespace: str) -> Coordinator:
    """The Ray monitor's coordinator under the Ray driver; else the store
    coordinator of the default process group (LocalCoordinator if none)."""
    if os.environ.get(monitor.MONITOR_ENV):
        # Imported here: ray is only present (and only needed) under the driver.
        from cairn.checkpoint import raycoordinator

        return raycoordinator.from_env(namespace=namespace)
    if not dist.is_available() or not dist.is_initialized():
        return LocalCoordinator()
    # The rendezvous store of the default group: torchrun's TCPStore.
    store: Store = dist.distributed_c10d._get_default_store()
    return StoreCoordinator(
        store, rank=dist.get_rank(), world_size=dist.get_world_size(), namespace=namespace
    )
