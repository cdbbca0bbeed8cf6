"""A worker that is not rank 0 waits, polling quickly, until rank 0's store listens.

``init_process_group`` with ``env://`` makes rank 0 start a TCPStore on
``MASTER_ADDR:MASTER_PORT`` and every other rank connect to it. A restarted
group's workers all start at the same moment, so another rank often tries
before rank 0's store is listening; torch then retries after its client's
backoff (``ExponentialBackoffWithJitter``: 1 s +-50% for the first retry, not
configurable from Python), and rank 0 waits for it the whole time (its
store waits for every worker). Measured on the devcluster (warm launcher,
2 nodes, one in-place restart, stacks sampled every 5 ms in both workers):
rank 1 tried 20 ms before rank 0's store existed and both workers sat 0.74 s
in ``_create_c10d_store`` of a 2.3 s recovery. The workers that win that race
lose nothing.

So the launchers (`cairn.trainer.launch`'s worker, the Ray rank actor) call
`wait_for_master_store` before the user's code: a plain TCP connect every
`POLL_SECONDS` until the port accepts one, then it closes that connection
(the store counts workers by their first request, never by connections)
and torch's own connect succeeds at its first try. Bounded by
`DEADLINE_SECONDS`; past it the worker goes on (with a warning) and torch's
own retries and timeout apply as before, so this never turns a failure into
a hang.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import logging
import socket
import time
import typing

log = logging.getLogger(__name__)

POLL_SECONDS = 0.01
"""Between two connects: a refused one costs a round trip, nothing more."""
DEADLINE_SECONDS = 3.0
"""At most this long before handing over to torch's own retries (its connect
then waits as it always did: a rank 0 that never comes fails there). Short,
because a trainer that starts no store at ``MASTER_PORT`` (its own
``init_method``, no process group at all) pays it at every start; a rank 0
that takes longer to reach ``init_process_group`` only loses the head start,
as before this wait existed."""
CONNECT_TIMEOUT_SECONDS = 1.0
"""One connect's bound: a host that drops packets must not stall the poll."""


@dataclasses.dataclass(frozen=True)
class Master:
    """Where rank 0's store will listen."""

    host: str
    port: int


def master_to_wait_for(env: collections.abc.Mapping[str, str]) -> Master | None:
    """The store to wait for, or None when this process has none to wait for. Pure.

    None for rank 0 (it starts the store), a world of one, a missing or
    malformed ``RANK`` / ``MASTER_ADDR`` / ``MASTER_PORT``, and torchelastic's
    agent store (``TORCHELASTIC_USE_AGENT_STORE=True``: the agent's store is
    already listening).
    """
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    host = env.get("MASTER_ADDR", "")
    try:
        rank = int(env.get("RANK", ""))
        port = int(env.get("MASTER_PORT", ""))
        world = int(env.get("WORLD_SIZE", "0"))
    except ValueError:
        return None
    if rank <= 0 or world == 1 or not host or not 0 < port < 65536:
        return None
    return Master(host=host, port=port)


def _connect(master: Master, timeout: float) -> None:
    with socket.create_connection((master.host, master.port), timeout=timeout):
        pass


def wait_for_master_store(
    env: collections.abc.Mapping[str, str],
    *,
    deadline_seconds: float = DEADLINE_SECONDS,
    poll_seconds: float = POLL_SECONDS,
    connect: typing.Callable[[Master, float], None] = _connect,
    clock: typing.Callable[[], float] = time.monotonic,
    sleep: typing.Callable[[float], None] = time.sleep,
) -> bool | None:
    """Until rank 0's store accepts a connection: True once it did, False when
    `deadline_seconds` passed first, None when there is nothing to wait for."""
    master = master_to_wait_for(env)
    if master is None:
        return None
    deadline = clock() + deadline_seconds
    while True:
        remaining = deadline - clock()
        try:
            connect(master, max(0.01, min(CONNECT_TIMEOUT_SECONDS, remaining)))
            return True
        except OSError:  # refused, unresolvable yet, timed out: not listening yet
            pass
        if clock() + poll_seconds >= deadline:
            log.warning(
                "rank 0's store at %s:%d did not accept a connection within %.0f s;"
                " torch's own connect takes over",
                master.host,
                master.port,
                deadline_seconds,
            )
            return False
        sleep(poll_seconds)
