"""Standby rank actors: the next group's processes, started and warmed before they are needed.

Ray gives every new actor a fresh worker process (a task's worker, or one
started with `worker_process_setup_hook`, is never handed to an actor:
tried on Ray 2.60, each of four actors got a new process that imported
torch itself, 3.0-4.0 s from `.remote()` to its first answer). After a rank
died, every rank of the next group paid that before its restore. So while a
group trains, the driver starts one standby `RankActor` per rank, in the
same placement-group bundle (the same node), which imports torch and the
checkpoint library (`PRELOAD`) and then waits; an in-place restart makes
the standbys the next group's ranks, and starts new standbys later.

    when     `STANDBY_AFTER_SECONDS` after a group started (not during its
             restore, which shares the node's CPUs), or
             `STANDBY_AFTER_NEW_NODE_SECONDS` after the first group on a
             node that replaced a lost one; only while in-place restarts
             are left, CPU-only ranks (below)
    resources  none of their own: the bundle's CPUs belong to the running
             rank until it dies, and a standby runs only after it has (Ray
             accounts the rank's CPUs to the bundle, reserved for the job)
    env      what a rank's process env holds that torch reads at import:
             the driver's forwarded TORCH* and OMP_* variables, and
             OMP_NUM_THREADS as Ray gives a rank of `cpus_per_rank` CPUs
             when the driver sets none (`process_env`). Nothing else: a
             runtime_env is kept in Ray's actor table and its agent's logs,
             so credentials (AWS_*) and the job's CAIRN_* settings travel
             only with `run`, as for every rank
    GPU ranks  not used: a standby has no GPU of its own in Ray's books and
             could not be tested here (no GPU lent); GPU ranks start fresh
             actors as before

Pure decisions here; the driver (`cairn.trainer.raydriver.driver`) does
the Ray calls.
"""

from __future__ import annotations

import math
import typing

STANDBY_AFTER_SECONDS = 2.0
"""A group's standbys start this long after it did (its ranks' start-up and
restore go first; a warm standby is ready ~3-4 s later on 2 cores)."""
STANDBY_AFTER_NEW_NODE_SECONDS = 10.0
"""The same for the first group after a lost node was replaced: its new
actors import torch and the trainer and restore from the peer while the new
node starts up, and standbys importing beside them from 2 s on slowed that
restart (Ray pod-loss MTTR, 2026-11-29 on the devcluster's 2 cores: 16.6 s
median at 16:14 with standbys after 2 s, 13.6 s at 17:26 with them after
10 s; group started -> "resumed" took 7.1-8.8 s in the first run's driver
log). A group started by standbys, or a job's first group, keeps 2 s: its
standbys must be ready for a failure that may come a few seconds later
(with 10 s there, the in-place MTTR run's kills all found none: 5.1 s
instead of 2.3 s)."""
ANSWER_SECONDS = 30.0
"""How long the driver waits for the standbys to answer when it needs them
(their imports take 3-4 s here); past it, fresh actors as before."""
PRELOAD = ("torch", "torch.distributed", "cairn.checkpoint")
"""What a standby imports before it is needed: what every rank imports
first. The user's module is not: it may read the rank's env at import."""
OMP = "OMP_NUM_THREADS"
IMPORT_ENV_PREFIXES = ("OMP_", "TORCH")
"""The forwarded variables a standby gets at start (what torch reads at import)."""


def wanted(
    *,
    enabled: bool,
    gpus_per_rank: float,
    restarts_done: int,
    budget: int,
    running_seconds: float,
    have: bool,
    new_node: bool,
) -> bool:
    """Whether to start the next group's standbys now (`new_node`: the running
    group is the first after a lost node was replaced). Pure."""
    after = STANDBY_AFTER_NEW_NODE_SECONDS if new_node else STANDBY_AFTER_SECONDS
    return (
        enabled
        and not have
        and gpus_per_rank == 0
        and restarts_done < budget
        and running_seconds >= after
    )


def process_env(forwarded: typing.Mapping[str, str], *, cpus_per_rank: float) -> dict[str, str]:
    """A standby's process env: what a fresh rank's process has, of what torch
    reads at import, when its `run` imports torch (the forwarded TORCH* and
    OMP_* variables over Ray's OMP_NUM_THREADS,
    `ray._private.utils.set_omp_num_threads_if_unset`: the floor of the
    actor's CPUs, at least 1). Pure."""
    env = {OMP: str(max(math.floor(cpus_per_rank), 1))}
    env.update({k: v for k, v in forwarded.items() if k.startswith(IMPORT_ENV_PREFIXES)})
    return env
