"""The reference FSDP2 trainer: `python -m cairn.trainer.reference` under torchrun.

Reads top to bottom as restore → step → checkpoint. A small decoder-only
transformer (`model`), sharded with FSDP2 `fully_shard` per block over a
device mesh (gloo on CPU, NCCL on GPU), AdamW with a warm-up/cosine
schedule, the deterministic corpus and stateful sampler (`data`), and the
`CheckpointManager` saving every `CAIRN_CHECKPOINT_INTERVAL_STEPS`. On
SIGTERM it checkpoints at the next step boundary and exits with
`PREEMPTED_EXIT_CODE`. After the last step it writes a final checkpoint and a
weights-only bf16 safetensors export. Rank 0 reports step and checkpoint
facts to the job's status when the pod contract asks for it. It resumes
from what the pod contract names (latest, a step, or `resume.uri`: a Cairn
step folder or a plain DCP checkpoint, imported); a target that cannot be
loaded exits `exitcodes.CONFIG_ERROR` (78) with the reason in the
termination message (`cairn.trainer.termination`), never a fresh start.

CPU runs are deterministic: the same command killed anywhere and resumed
produces the same per-step losses, bit for bit (`--losses-file` records them).
"""

import argparse
import dataclasses
import datetime
import json
import logging
import math
import os
import pathlib
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import device_mesh
from torch.distributed.checkpoint import state_dict as dcp_state_dict
from torch.distributed.fsdp import fully_shard

from cairn.api import jobstatus
from cairn.checkpoint import errors, events, fence, manager, state
from cairn.trainer import (
    checkpoint_status,
    data,
    model,
    runtime_config,
    status_reporter,
    termination,
)

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


class StatusFeed:
    """Rank 0: folds checkpoint events and the step into the status reporter."""

    def __init__(self, *, cfg: runtime_config.RuntimeConfig) -> None:
        self._lock = threading.Lock()
        s3 = cfg.checkpoint.s3
        self.tracker = checkpoint_status.Tracker(upload_uri=s3.uri if s3 else None)
        self.step: int | None = None  # unknown until restored or stepped
        self.reporter: status_reporter.StatusReporter | None = None
        self.fence: fence.Fence | None = None
        """Rank 0's authoritative fence: the job's UID and attempt from the API server."""
        if cfg.report_status and cfg.job_name and cfg.namespace:
            from kubernetes import client, config

            config.load_incluster_config()
            api_client = client.ApiClient()
            if cfg.checkpoint.job_uid:
                self.fence = fence.ApiFence(
                    get_job=status_reporter.job_reader(
                        api_client=api_client, namespace=cfg.namespace, name=cfg.job_name
                    ),
                    job_uid=cfg.checkpoint.job_uid,
                    group=cfg.checkpoint.group,
                )
            previous = status_reporter.read_checkpoints(
                api_client=api_client, namespace=cfg.namespace, name=cfg.job_name
            )
            self.tracker = checkpoint_status.continued(previous, upload_uri=self.tracker.upload_uri)
            self.reporter = status_reporter.StatusReporter(
                patch=status_reporter.kubernetes_patcher(
                    api_client=api_client, namespace=cfg.namespace, name=cfg.job_name
                ),
                status_interval_seconds=cfg.status_interval_seconds,
            )

    def _now(self) -> datetime.datetime:
        return datetime.datetime.now(datetime.UTC)

    def on_event(self, event: events.ProgressEvent) -> None:
        with self._lock:
            self.tracker = checkpoint_status.apply(self.tracker, event, now=self._now())
            self._push()

    def on_step(self, step: int | None) -> None:
        with self._lock:
            self.step = step
            self._push()

    def on_resume(self, resumed: jobstatus.ResumedFrom) -> None:
        with self._lock:
            self.tracker = checkpoint_status.resumed(self.tracker, resumed)
            self._push()

    def _push(self) -> None:
        if self.reporter is not None:
            self.reporter.update(step=self.step, checkpoints=self.tracker.status)

    def close(self) -> None:
        if self.reporter is not None and not self.reporter.close():
            log.warning("could not deliver the final status report")


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
    feed: StatusFeed | None,
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
    if feed:
        feed.on_resume(
            jobstatus.ResumedFrom(
                step=result.step,
                attempt=cfg.attempt or None,
                source="remote" if result.source == "s3" else "local",
                uri=result.uri,
                fell_back_from=max((s for s, _ in result.skipped), default=None),
                imported=result.imported or None,
            )
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


def _train(args: argparse.Namespace, cfg: runtime_config.RuntimeConfig) -> int:
    rank, world, device = _init_distributed()
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)

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
    feed = StatusFeed(cfg=cfg) if rank == 0 else None
    callbacks = [feed.on_event] if feed else []
    losses = args.losses_file.open("a") if args.losses_file and rank == 0 else None
    exit_code = 0
    ckpt_opts = cfg.checkpoint
    if feed is not None and feed.fence is not None:
        ckpt_opts = dataclasses.replace(ckpt_opts, fence=feed.fence)
    with manager.CheckpointManager(ckpt_opts, callbacks=callbacks) as ckpt:
        ckpt.install_sigterm_handler()
        # -- restore
        _resume(ckpt, objects, cfg=cfg, feed=feed)
        if feed:
            feed.on_step(train.step)
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
                losses.write(json.dumps({"step": train.step, "loss": value.item() / world}) + "\n")
                losses.flush()
            if feed:
                feed.on_step(train.step)
            if args.step_delay:
                torch.distributed.barrier()
                import time

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
    if feed:
        feed.close()
    dist.destroy_process_group()
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
