"""The warm launcher's quick rendezvous poll on torch's real c10d rendezvous.

Covers: with `launch.rendezvous_polls_quickly` applied to the locked torch's
`dynamic_rendezvous` (in a child interpreter: the patch is process-wide),
two real `DynamicRendezvousHandler`s on one TCPStore complete a first round
(the second node joins late, so the first one polls) and then an in-place
restart's round (one node rejoins as a failed worker's agent does, the other
sees it waiting through `num_nodes_waiting` and rejoins); every poll sleeps
the given 0.1 s, never torch's 1 s, the other delays pass through
unchanged, and the state holder caches reads for 0.1 s. Each round's
seconds are printed, not asserted (timing lives in bench/mttr.py).
"""

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.torch

CHILD = textwrap.dedent(
    """
    import json, threading, time
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    from cairn.trainer import launch

    delays = []
    real_delay = dr._delay

    def recorded(seconds):
        delays.append(seconds)
        real_delay(seconds=seconds)

    dr._delay = recorded
    assert launch.rendezvous_polls_quickly(dr, seconds=0.1)

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    params = RendezvousParameters(
        backend="c10d", endpoint=f"127.0.0.1:{server.port}", run_id="quick-poll",
        min_nodes=2, max_nodes=2, join_timeout="60",
    )
    # A client per node, as each agent has its own (one client blocks its
    # other callers while a blocking get waits).
    stores = [
        dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=60))
        for _ in range(2)
    ]
    handlers = [
        dr.create_handler(store, C10dRendezvousBackend(store, "quick-poll"), params)
        for store in stores
    ]
    caches = [h._state_holder._cache_duration for h in handlers]
    worlds = {}

    def join(index, round_):
        info = handlers[index].next_rendezvous()
        worlds[(round_, index)] = (info.rank, info.world_size)

    # Round 1: node 1 joins 0.3 s after node 0, which polls meanwhile.
    t0 = time.monotonic()
    first = threading.Thread(target=join, args=(0, 1))
    first.start()
    time.sleep(0.3)
    join(1, 1)
    first.join(60)
    round1 = time.monotonic() - t0

    # Round 2, an in-place restart: node 1's worker failed, its agent rejoins;
    # node 0's agent restarts once it sees a node waiting.
    t0 = time.monotonic()
    failed = threading.Thread(target=join, args=(1, 2))
    failed.start()
    deadline = time.monotonic() + 30
    while handlers[0].num_nodes_waiting() == 0:
        assert time.monotonic() < deadline, "node 0 never saw node 1 waiting"
        time.sleep(0.1)
    seen = time.monotonic() - t0
    join(0, 2)
    failed.join(60)
    round2 = time.monotonic() - t0
    for h in handlers:
        h.shutdown()
    print(json.dumps({
        "delays": [list(d) if isinstance(d, tuple) else d for d in delays],
        "caches": caches,
        "worlds": sorted([list(k) + list(v) for k, v in worlds.items()]),
        "seconds": {"round1": round1, "round2_seen": seen, "round2": round2},
    }))
    """
)


def test_a_real_c10d_restart_round_polls_every_tenth_of_a_second() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print("rendezvous seconds:", result["seconds"])
    # Both rounds complete with both nodes, ranks 0 and 1 of 2.
    worlds = result["worlds"]
    assert [w[0] for w in worlds] == [1, 1, 2, 2]
    assert sorted((w[2], w[3]) for w in worlds if w[0] == 1) == [(0, 2), (1, 2)]
    assert sorted((w[2], w[3]) for w in worlds if w[0] == 2) == [(0, 2), (1, 2)]
    assert result["caches"] == [0.1, 0.1]
    polls = [d for d in result["delays"] if not isinstance(d, list)]
    assert polls, "the first node never polled: the test did not exercise the poll"
    assert all(d == 0.1 for d in polls), result["delays"]  # never torch's 1 s
    # The first round's random skew reaches torch as it was.
    assert [0, 0.3] in result["delays"]
