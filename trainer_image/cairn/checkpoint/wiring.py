"""What a `CheckpointManager` is wired to: its coordinator, fences and process group.

Built once when a manager starts, never changed after:

- the coordinator (default: the c10d store of the default process group,
  under a namespace unique to this manager of this attempt) and its
  heartbeat (a gather gives up early on a rank whose beat stopped);
- the writer's group under torchrun in-place restarts (`with_torchrun_group`);
- the fences a commit checks: the caller's, the API server's (rank 0 under
  the operator, `status_feed`) and the Ray monitor's (a replaced rank-actor
  group is refused right before each commit);
- a dedicated gloo group for DCP's collectives.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import os
from collections.abc import Mapping

import torch.distributed as dist

from cairn.api import podenv
from cairn.checkpoint import coordinator as coordinator_mod
from cairn.checkpoint import errors, monitor, options, status_feed, torchrun_group
from cairn.checkpoint import fence as fence_mod

_instances = itertools.count()


def coordinator_for(
    opts: options.CheckpointOptions, *, given: coordinator_mod.Coordinator | None
) -> coordinator_mod.Coordinator:
    """`given`, else the default group's store under this manager's namespace.

    Every rank constructs managers in the same order, so the counter gives
    the same namespace everywhere and two managers of one attempt never read
    each other's keys (the counter advances either way)."""
    namespace = f"cairn-ckpt/attempt-{opts.attempt}/manager-{next(_instances)}"
    return given or coordinator_mod.from_default_group(namespace=namespace)


def start_heartbeat(coordinator: coordinator_mod.Coordinator, *, group: int) -> bool:
    """Start the heartbeat of a store coordinator this manager built (none
    under Ray, whose driver replaces a group whose actor died; none in a
    world of one). Keyed by the worker group: a new group never reads a dead
    group's last beat."""
    if not isinstance(coordinator, coordinator_mod.StoreCoordinator):
        return False
    coordinator.start_heartbeat(f"group-{group}")
    return True


def stop_heartbeat(coordinator: coordinator_mod.Coordinator) -> None:
    if isinstance(coordinator, coordinator_mod.StoreCoordinator):
        coordinator.close()


def with_torchrun_group(
    opts: options.CheckpointOptions,
    *,
    coordinator: coordinator_mod.Coordinator,
    environ: Mapping[str, str] | None = None,
) -> options.CheckpointOptions:
    """`opts` with the worker group every rank agrees on (torchrun in-place restarts).

    Under c10d rendezvous each node's agent counts only the restarts its own
    workers' failures caused, and a replaced pod's agent counts from 0 again,
    so the generation comes from one gather of every rank's count, pod and
    fence record (`torchrun_group.agreed`): the same group for another
    manager of it, else one above the newest group any rank's fence file
    recorded for this attempt (0 for the attempt's first). Skipped (no store
    round trip) unless torchrun may restart (TORCHELASTIC_MAX_RESTARTS > 0)
    and no Ray group is set."""
    env = os.environ if environ is None else environ
    if env.get(monitor.GROUP_ENV) or not _int(env.get("TORCHELASTIC_MAX_RESTARTS")):
        return opts
    own = torchrun_group.group_from_env(env)
    if coordinator.world_size <= 1:
        return dataclasses.replace(opts, group=own)
    record = _fence_record(opts)
    coordinator.publish(
        GROUP_KEY,
        {
            "restarts": own,
            "pod": env.get(podenv.POD_UID, ""),
            "fenced": None if record is None else record.group,
            "fencedMembers": None if record is None else record.members,
        },
    )
    reports = coordinator.gather(GROUP_KEY, timeout=GROUP_TIMEOUT_SECONDS)
    group, members = torchrun_group.agreed(reports)
    return dataclasses.replace(opts, group=group, group_members=members)


def _fence_record(opts: options.CheckpointOptions) -> fence_mod.FenceRecord | None:
    """This attempt's record in this rank's fence file (None: none, another
    attempt's or job's, or unreadable: startup reports that one)."""
    try:
        record = fence_mod.read_record(opts.directory)
    except errors.CheckpointError:
        return None
    if record is None or record.attempt != opts.attempt:
        return None
    if record.job_uid is not None and opts.job_uid is not None and record.job_uid != opts.job_uid:
        return None
    return record


GROUP_KEY = "torchrun-group"
GROUP_TIMEOUT_SECONDS = 300.0
"""Every rank constructs its manager within this after the rendezvous."""


def _int(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        return int(str(value))
    except ValueError:
        return 0


def with_fences(
    opts: options.CheckpointOptions,
    *,
    coordinator: coordinator_mod.Coordinator,
    feed: status_feed.StatusFeed | None,
) -> options.CheckpointOptions:
    """`opts` with every fence that applies (the caller's first)."""
    added: list[fence_mod.Fence] = []
    if feed is not None and feed.api_fence is not None:
        added.append(feed.api_fence)
    if isinstance(coordinator, coordinator_mod.Fencing):
        added.append(coordinator.commit_fence())
    if not added:
        return opts
    own = () if opts.fence is None else (opts.fence,)
    return dataclasses.replace(opts, fence=fence_mod.AllOf(fences=(*own, *added)))


def checkpoint_group(opts: options.CheckpointOptions) -> dist.ProcessGroup | None:
    """DCP's collectives get their own gloo group: on the training group they
    would interleave with FSDP's and deadlock. None without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=opts.timeout_seconds))
    if not isinstance(group, dist.ProcessGroup):
        raise errors.CheckpointError("this rank is not a member of the checkpoint group")
    return group
