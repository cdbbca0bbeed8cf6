"""An empty Adam/AdamW state for DTensor (FSDP2) parameters, made on their local shards.

A restore loads the optimizer's state into a template: DCP's ``get_state_dict``
makes one, when the optimizer has no state yet, by one ``step()`` with zero
gradients and a learning rate of 0 (``_init_optim_state``). Over FSDP2's
DTensor parameters that step dispatches every elementwise op of Adam through
DTensor (sharding propagation per op): measured in a restarted worker of the
devcluster's quickstart (29 parameters, 2 ranks), 0.13-0.16 s of a warm
in-place restart's ~0.45 s start, on both ranks. The same step on each
parameter's local shard (a plain tensor sharing the DTensor's storage) is a
few milliseconds; Adam's state is elementwise, so each state tensor shaped
like the shard becomes a DTensor with the parameter's mesh, placements, shape
and stride: what DCP's step makes (``zeros_like`` of the DTensor), scalars
(``step``) stay plain as there.

Only for ``torch.optim.Adam`` and ``AdamW`` themselves, neither fused nor
capturable nor differentiable, with at least one DTensor parameter and no
0-dim one, no gradient present and no state yet (DCP's own preconditions);
anything else returns False and DCP makes the template as before.
`tests/integration/checkpoint/test_optimstate.py` compares this template
with DCP's on a real 2-rank FSDP2 model, key by key, type, spec and value.
"""

from __future__ import annotations

import typing

import torch
from torch.distributed.tensor import DTensor

ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW)
"""Optimizers whose state per parameter is the parameter's shape, elementwise
(and the scalar ``step``): their step on a shard is their step on the whole."""
OFF_FLAGS = ("fused", "capturable", "differentiable")


def _eligible(optimizer: torch.optim.Optimizer) -> bool:
    if type(optimizer) not in ELEMENTWISE or optimizer.state:
        return False
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(p.grad is not None for p in params):
        return False
    if any(group.get(flag) for group in optimizer.param_groups for flag in OFF_FLAGS):
        return False
    dtensors = [p for p in params if isinstance(p, DTensor)]
    return bool(dtensors) and all(p.dim() > 0 for p in dtensors)


def init_on_shards(optimizer: torch.optim.Optimizer) -> bool:
    """Give `optimizer` the state DCP's template step would, stepping the local
    shards instead of the DTensors (see the module doc); False, nothing done,
    where it does not apply. Parameters and learning rates are left as found."""
    if not _eligible(optimizer):
        return False
    groups = optimizer.param_groups
    saved = [(group["params"], group.get("lr")) for group in groups]
    local_of: dict[int, tuple[torch.Tensor, DTensor]] = {}
    try:
        with torch.no_grad():
            for group in groups:
                shards = []
                for param in group["params"]:
                    shard = param.to_local() if isinstance(param, DTensor) else param
                    if isinstance(param, DTensor):
                        local_of[id(shard)] = (shard, param)
                    # The shard (the DTensor's storage) does not require grad itself:
                    # the zero gradient goes where the parameter would get one.
                    if param.requires_grad:
                        shard.grad = torch.zeros_like(shard)
                    shards.append(shard)
                group["params"] = shards
                if "lr" in group:  # as DCP: a step that must not move a parameter
                    lr = group["lr"]
                    group["lr"] = torch.tensor(0.0) if isinstance(lr, torch.Tensor) else 0.0
        optimizer.step()
    finally:
        for group, (params, lr) in zip(groups, saved, strict=True):
            for param in group["params"]:
                param.grad = None
            group["params"] = params
            if "lr" in group:
                group["lr"] = lr
    for shard, param in local_of.values():
        if shard in optimizer.state:
            optimizer.state[param] = _as_dtensors(optimizer.state.pop(shard), shard, param)
    return True


def _as_dtensors(
    entry: dict[str, typing.Any], shard: torch.Tensor, param: DTensor
) -> dict[str, typing.Any]:
    """A shard's state with each tensor shaped like the shard as a DTensor of `param`'s spec."""

    def spread(value: typing.Any) -> typing.Any:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shard.shape:
            return DTensor.from_local(
                value,
                param.device_mesh,
                param.placements,
                run_check=False,
                shape=param.shape,
                stride=param.stride(),
            )
        return value

    return {key: spread(value) for key, value in entry.items()}
