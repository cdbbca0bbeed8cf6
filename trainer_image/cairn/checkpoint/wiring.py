"""What a `CheckpointManager` is wired to: its coordinator, fences and process group.

Built once when a manager starts, never changed after:

- the coordinator (default: the c10d store of the default process group,
  under a namespace unique to this manager of this attempt);
- the fences a commit checks: the caller's, the API server's (rank 0 under
  the operator, `status_feed`) and the Ray monitor's (a replaced rank-actor
  group is refused right before each commit);
- a dedicated gloo group for DCP's collectives.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools

import torch.distributed as dist

from cairn.checkpoint import coordinator as coordinator_mod
from cairn.checkpoint import errors, options, status_feed
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
