"""The reference FSDP2 trainer: `python -m cairn.trainer.reference` under torchrun.

Reads top to bottom as restore → step → checkpoint. A small decoder-only
transformer (`model`), sharded with FSDP2 `fully_shard` per block over a
device mesh (gloo on CPU, NCCL on GPU), AdamW with a warm-up/cosine
schedule, the deterministic corpus and stateful sampler (`data`), and the
`CheckpointManager` saving every `CAIRN_CHECKPOINT_INTERVAL_STEPS`. On
SIGTERM it checkpoints at the next step boundary and exits with
`PREEMPTED_EXIT_CODE`. After the last step it writes a final checkpoint and a
weights-only bf16 safetensors export, and leaves through
`process_exit.exit_process` (no interpreter finalization: see there). It is
a plain user of the library: under the operator the `CheckpointManager`
itself reports the step and the checkpoint facts to the job's status and
checks the API fence. It resumes from what the pod contract names (latest,
a step, or `resume.uri`: a Cairn step folder or a plain DCP checkpoint,
imported); a target that cannot be loaded exits `exitcodes.CONFIG_ERROR`
(78) with the reason in the termination message (`cairn.trainer.termination`),
never a fresh start.

CPU runs are deterministic: the same command killed anywhere and resumed
produces the same per-step losses, bit for bit (`--losses-file` records them).
"""

import argparse
import json
import logging
import math
import os
import pathlib
import time
import typing
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import device_mesh
from torch.distributed.checkpoint import state_dict as dcp_state_dict
from torch.distributed.fsdp import fully_shard

from cairn.checkpoint import errors, manager, process_exit, runtime_config, state
from cairn.trainer import data, model, termination

log = logging.getLogger("cairn.trainer")
PREEMPTED_EXIT_CODE = 143
"""Exit code after a clean preemption checkpoint (128 + SIGTERM, as a shell reports it)."""


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cairn.trainer.reference", description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (demos)")
    parser.add_argument("--losses-file", type=pathlib.Path, default=None)
    parser.add_argument("--export", type=pathlib.Path, default=None, help="safetensors path")
    parser.add_argument("--checkpoint-dir", type=pathlib.Path, default=None)
    return parser.parse_args(argv)


def _init_distributed() -> tuple[int, int, str]:
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    return dist.get_rank(), dist.get_world_size(), "cuda" if cuda else "cpu"


def _schedule(optimizer: torch.optim.Optimizer, *, warmup: int, total: int) -> Any:
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _export(model_: torch.nn.Module, path: pathlib.Path, *, rank: int) -> None:
    """Weights only, full (unsharded) tensors in bf16, written by rank 0."""
    from safetensors.torch import save_file

    full = dcp_state_dict.get_model_state_dict(
        model_,
        options=dcp_state_dict.StateDictOptions(full_state_dict=True, cpu_offload=True),
    )
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {
            k: v.to(torch.bfloat16).contiguous()
            for k, v in full.items()
            if isinstance(v, torch.Tensor)
        }
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        os.replace(tmp, path)


def _resume(
    ckpt: manager.CheckpointManager,
    objects: dict[str, Any],
    *,
    cfg: runtime_config.RuntimeConfig,
) -> None:
    """Restore what the pod contract asks for; an explicit target that cannot be
    loaded raises ConfigurationError (never a silent fresh start)."""
    if cfg.resume.kind == "none":
        return
    result = ckpt.restore(
        objects,
        step=cfg.resume.step,
        uri=cfg.resume.uri,
        key_map=cfg.import_keys,
        sha256=cfg.resume.sha256,
    )
    if result is None:
        log.info("nothing to resume from: starting fresh")
        return
    log.info(
        "resumed from step %d (%s%s)",
        result.step,
        result.source,
        f", imported from {result.uri or 'a foreign folder'}" if result.imported else "",
    )


def main(argv: list[str] | None = None) -> int:
    """Train; a deterministic start-up failure exits `exitcodes.CONFIG_ERROR` with
    the reason in the termination message (`cairn.trainer.termination`)."""
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        cfg = runtime_config.from_env(default_dir=args.checkpoint_dir)
    except (ValueError, errors.ConfigurationError) as exc:
        return termination.config_error(exc)
    try:
        return _train(args, cfg)
    except errors.ConfigurationError as exc:
        code = termination.config_error(exc)
        if dist.is_initialized():
            dist.destroy_process_group()
        return code


class _Run(typing.NamedTuple):
    """What the loop trains and checkpoints."""

    net: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: data.ShardedSampler
    train: state.TrainState
    objects: dict[str, Any]


def _build(args: argparse.Namespace, *, rank: int, world: int, device: str) -> _Run:
    """The FSDP2-sharded model, AdamW, the schedule, the sampler and their state."""
    mcfg = model.ModelConfig(
        vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, seq_len=args.seq_len
    )
    net = model.Decoder(mcfg).to(device)
    mesh = device_mesh.init_device_mesh(device, (world,))
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, foreach=False)
    scheduler = _schedule(optimizer, warmup=args.warmup, total=args.steps)
    corpus = data.Corpus(vocab=args.vocab, seq_len=args.seq_len, size=4096, seed=args.seed)
    sampler = data.ShardedSampler(
        corpus=corpus, batch_per_rank=args.batch_per_rank, rank=rank, world=world
    )
    train = state.TrainState()
    objects = {
        "model": state.ModelOptimizerState(net, optimizer),
        "lr_scheduler": scheduler,
        "rng": state.RNGState(),
        "data": sampler,
        "train": train,
    }
    return _Run(net, optimizer, scheduler, sampler, train, objects)


def _train(args: argparse.Namespace, cfg: runtime_config.RuntimeConfig) -> int:
    rank, world, device = _init_distributed()
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    net, optimizer, scheduler, sampler, train, objects = _build(
        args, rank=rank, world=world, device=device
    )
    losses = args.losses_file.open("a") if args.losses_file and rank == 0 else None
    exit_code = 0
    with manager.CheckpointManager(cfg.checkpoint) as ckpt:
        ckpt.install_sigterm_handler()
        # -- restore
        _resume(ckpt, objects, cfg=cfg)
        ckpt.report_step(train.step)  # a fresh start is step 0
        # -- step
        while train.step < args.steps:
            batch = sampler.next_batch().to(device)
            loss = model.loss_fn(net, batch)
            loss.backward()  # type: ignore[no-untyped-call]
            ckpt.wait_until_staged()  # the snapshot must not see this update
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            train.step += 1
            train.tokens_seen += batch.numel() * world
            value = loss.detach().clone()
            dist.all_reduce(value)
            if losses:
                # "time" (wall clock) lets a test read steps/s from the trainer's own log.
                entry = {"step": train.step, "loss": value.item() / world, "time": time.time()}
                losses.write(json.dumps(entry) + "\n")
                losses.flush()
            if args.step_delay:
                torch.distributed.barrier()
                time.sleep(args.step_delay)
            # -- checkpoint
            last = train.step == args.steps
            ckpt.save(train.step, objects, force=last)
            if ckpt.reached_final(train.step):
                log.info("preempted: final checkpoint at step %d committed", train.step)
                exit_code = PREEMPTED_EXIT_CODE
                break
        ckpt.wait_until_finished()
    if exit_code == 0 and args.export:
        _export(net, args.export, rank=rank)
    if losses:
        losses.close()
    dist.destroy_process_group()
    return exit_code


if __name__ == "__main__":
    # Not sys.exit: past the last step, interpreter finalization can race a gloo
    # thread into SIGABRT (exit -6) and cost the job a restart (`process_exit`).
    process_exit.exit_process(main())
