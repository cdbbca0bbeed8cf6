"""The optimizer template made on local shards (`cairn.checkpoint.optimstate`) is DCP's.

Two real gloo ranks (spawned processes), the reference trainer's FSDP2
decoder sharded per block, sized so the shards are uneven and one
parameter's shard is empty on rank 1. Each rank builds the model twice from
one seed: one optimizer gets DCP's template (``get_state_dict`` runs its own
zero-gradient step over the DTensors), the other `init_on_shards` first.
Compared entry by entry: the same keys, the same types, for DTensors the same
mesh, placements, global shape and stride and local values, plain tensors
equal; the parameters and learning rates untouched. And where it does not
apply (SGD, fused, a gradient present, state already there) it does nothing.
"""

from __future__ import annotations

import multiprocessing
import typing

import pytest

from tests.integration.checkpoint import ckpt_harness

WORLD = 2


def _models(optimizer_kwargs: dict[str, typing.Any], cls_name: str = "AdamW") -> typing.Any:
    import torch
    from torch.distributed import device_mesh
    from torch.distributed.fsdp import fully_shard

    from cairn.trainer import model

    # vocab 7 and seq_len 1: the embeddings' rows shard 4/3 and 1/0.
    cfg = model.ModelConfig(vocab=7, dim=16, layers=2, heads=2, seq_len=1)
    mesh = device_mesh.init_device_mesh("cpu", (WORLD,))
    built = []
    for _ in range(2):
        torch.manual_seed(0)
        net = model.Decoder(cfg)
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        opt = getattr(torch.optim, cls_name)(net.parameters(), **optimizer_kwargs)
        built.append((net, opt))
    return built


def _differences(got: dict[str, typing.Any], want: dict[str, typing.Any]) -> list[str]:
    import torch
    from torch.distributed.tensor import DTensor

    out: list[str] = []
    if got.keys() != want.keys():
        return [f"keys {sorted(got)} != {sorted(want)}"]
    for key, b in want.items():
        a = got[key]
        if type(a) is not type(b):
            out.append(f"{key}: {type(a).__name__} != {type(b).__name__}")
        elif isinstance(b, DTensor):
            if (a.device_mesh, a.placements, a.shape, a.stride()) != (
                b.device_mesh,
                b.placements,
                b.shape,
                b.stride(),
            ):
                out.append(f"{key}: spec {a.placements} {a.shape} != {b.placements} {b.shape}")
            elif not torch.equal(a.to_local(), b.to_local()):
                out.append(f"{key}: local values differ")
        elif isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
                out.append(f"{key}: {a} != {b}")
        elif isinstance(b, dict):
            out += [f"{key}.{d}" for d in _differences(a, b)]
        elif a != b:
            out.append(f"{key}: {a!r} != {b!r}")
    return out


def _rank(rank: int, port: int, results: typing.Any) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint import state_dict as dcp_state_dict

    from cairn.checkpoint import optimstate

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        report: dict[str, typing.Any] = {}
        cases: dict[str, dict[str, typing.Any]] = {
            "adamw": {"lr": 1e-3, "weight_decay": 0.1, "foreach": False},
            "adamw-lr-tensor": {"lr": torch.tensor(1e-3), "amsgrad": True},
        }
        for name, kwargs in cases.items():
            (theirs_net, theirs), (ours_net, ours) = _models(kwargs)
            before = {k: v.to_local().clone() for k, v in ours_net.state_dict().items()}
            lrs = [group["lr"] for group in ours.param_groups]
            report[f"{name} applied"] = optimstate.init_on_shards(ours)
            after = {k: v.to_local() for k, v in ours_net.state_dict().items()}
            report[f"{name} params moved"] = [
                k for k in before if not torch.equal(before[k], after[k])
            ]
            report[f"{name} lr kept"] = all(
                a is b for a, b in zip(lrs, (g["lr"] for g in ours.param_groups), strict=True)
            )
            report[f"{name} grads left"] = [
                n for n, p in ours_net.named_parameters() if p.grad is not None
            ]
            _, want = dcp_state_dict.get_state_dict(theirs_net, theirs)
            _, got = dcp_state_dict.get_state_dict(ours_net, ours)
            report[f"{name} differences"] = _differences(got, want)
        (_, sgd), _ = _models({"lr": 0.1, "momentum": 0.9}, "SGD")
        report["sgd applied"] = optimstate.init_on_shards(sgd)
        (_, fused), _ = _models({"lr": 0.1, "fused": True})
        report["fused applied"] = optimstate.init_on_shards(fused)
        (net, with_grad), _ = _models({"lr": 0.1})
        next(net.parameters()).grad = torch.zeros_like(next(net.parameters()))
        report["with a gradient applied"] = optimstate.init_on_shards(with_grad)
        (_, twice), _ = _models({"lr": 0.1})
        report["first applied"] = optimstate.init_on_shards(twice)
        report["again applied"] = optimstate.init_on_shards(twice)
        results.put((rank, report))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports() -> dict[int, dict[str, typing.Any]]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = ckpt_harness.free_port()
    procs = [ctx.Process(target=_rank, args=(rank, port, results)) for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    out = dict(results.get(timeout=180) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    return out


@pytest.mark.parametrize("rank", range(WORLD))
@pytest.mark.parametrize("name", ["adamw", "adamw-lr-tensor"])
def test_the_shard_template_is_dcps(
    reports: dict[int, dict[str, typing.Any]], rank: int, name: str
) -> None:
    report = reports[rank]
    assert report[f"{name} applied"]
    assert report[f"{name} differences"] == []
    assert report[f"{name} params moved"] == []
    assert report[f"{name} lr kept"]
    assert report[f"{name} grads left"] == []


@pytest.mark.parametrize("rank", range(WORLD))
@pytest.mark.parametrize(
    "case", ["sgd applied", "fused applied", "with a gradient applied", "again applied"]
)
def test_where_it_does_not_apply_dcp_makes_the_template(
    reports: dict[int, dict[str, typing.Any]], rank: int, case: str
) -> None:
    assert reports[rank]["first applied"]
    assert not reports[rank][case]
