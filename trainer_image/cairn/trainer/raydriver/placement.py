"""Where the ranks go: one placement-group bundle per rank. Pure.

Rank r runs on node `r // procs_per_node` (node 0 = the head, the driver's
node), like torchrun's node ranks. Ray cannot say "these P bundles together,
each group on another node" with a strategy alone (STRICT_SPREAD allows one
bundle per node), so each bundle carries a label selector on the node id
Ray gives every node (`ray.io/node-id`) and the strategy is PACK.
"""

from __future__ import annotations

import dataclasses

NODE_ID_LABEL = "ray.io/node-id"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    bundles: list[dict[str, float]]
    selectors: list[dict[str, str]]
    node_of_rank: list[int]
    """Node index (0 = head) of each rank."""


def world_size(*, nodes: int, procs_per_node: int) -> int:
    if nodes < 1 or procs_per_node < 1:
        raise ValueError(f"nodes ({nodes}) and procs per node ({procs_per_node}) must be >= 1")
    return nodes * procs_per_node


def order_nodes(node_ids: list[str], *, head: str) -> list[str]:
    """The head's node first (rank 0 and MASTER_ADDR live there), then the rest sorted."""
    if head not in node_ids:
        raise ValueError(f"the driver's node {head} is not among the alive nodes")
    return [head, *sorted(n for n in node_ids if n != head)]


def keep_positions(previous: list[str], alive: list[str]) -> list[str]:
    """Node order for a new placement after a node loss: every node of `previous`
    still alive keeps its position (its pod's ranks, and their memory copies,
    stay where they were), a lost one's position goes to a node that was not in
    `previous` (the replacement pod's), first come by id; the rest follow. Pure."""
    fresh = sorted(n for n in alive if n not in previous)
    ordered = []
    for node in previous:
        if node in alive:
            ordered.append(node)
        elif fresh:
            ordered.append(fresh.pop(0))
        else:
            raise ValueError(f"{len(previous)} nodes wanted, {len(alive)} alive in the Ray cluster")
    return [*ordered, *fresh]


def layout(
    node_ids: list[str], *, nodes: int, procs_per_node: int, cpus: float, gpus: float
) -> Layout:
    """Bundles and node selectors for `nodes * procs_per_node` ranks on `node_ids` (ordered)."""
    world = world_size(nodes=nodes, procs_per_node=procs_per_node)
    if len(node_ids) < nodes:
        raise ValueError(f"{nodes} nodes wanted, {len(node_ids)} alive in the Ray cluster")
    bundle: dict[str, float] = {"CPU": cpus}
    if gpus:
        bundle["GPU"] = gpus
    node_of_rank = [rank // procs_per_node for rank in range(world)]
    return Layout(
        bundles=[dict(bundle) for _ in range(world)],
        selectors=[{NODE_ID_LABEL: node_ids[node]} for node in node_of_rank],
        node_of_rank=node_of_rank,
    )


def rank_env(rank: int, *, node_of_rank: list[int], procs_per_node: int) -> dict[str, str]:
    """The torchrun-style rank variables of `rank`."""
    node = node_of_rank[rank]
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(len(node_of_rank)),
        "LOCAL_RANK": str(rank - node * procs_per_node),
        "LOCAL_WORLD_SIZE": str(procs_per_node),
        "GROUP_RANK": str(node),
        "NODE_RANK": str(node),
        "CAIRN_NODE_RANK": str(node),
    }


def cuda_env(gpu_ids: list[list[str]], *, node_of_rank: list[int]) -> list[dict[str, str]]:
    """Per rank: CUDA_VISIBLE_DEVICES = every GPU of the node's ranks, LOCAL_RANK = own index.

    Ray gives each actor only its own GPU; NCCL between the ranks of a node
    wants them to see each other's devices, and the trainer picks its device
    by LOCAL_RANK (torchrun's convention). Ranks without GPUs get nothing.
    """
    by_node: dict[int, list[str]] = {}
    for rank, ids in enumerate(gpu_ids):
        by_node.setdefault(node_of_rank[rank], []).extend(ids)
    out: list[dict[str, str]] = []
    for rank, ids in enumerate(gpu_ids):
        if not ids:
            out.append({})
            continue
        visible = sorted(set(by_node[node_of_rank[rank]]), key=_gpu_order)
        out.append(
            {"CUDA_VISIBLE_DEVICES": ",".join(visible), "LOCAL_RANK": str(visible.index(ids[0]))}
        )
    return out


def _gpu_order(gpu: str) -> tuple[int, str]:
    return (int(gpu), gpu) if gpu.isdigit() else (1 << 30, gpu)
