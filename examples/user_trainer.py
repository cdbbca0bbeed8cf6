"""A user's own training script, written from docs/trainer.md alone.

An MLP sharded with FSDP2 `fully_shard`, AdamW and a StepLR schedule,
checkpointed by Cairn's `CheckpointManager` (`cairn.checkpoint` only, no
`cairn.trainer`). Under a TrainingJob the manager also reports the job's
status (STEP, COMMITTED, UPLOADED, RESUMED-FROM) and fences stale writers;
on a laptop it just checkpoints to `./checkpoints`:

    torchrun --nproc-per-node 2 examples/user_trainer.py --steps 30

`tests/e2e/test_user_script.py` runs it as a TrainingJob and SIGKILLs rank 1.
"""

import argparse
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import device_mesh
from torch.distributed.fsdp import fully_shard

from cairn.checkpoint import manager, process_exit, runtime_config, state

PREEMPTED = 143


class Sampler:
    """A deterministic synthetic regression stream; its position is checkpointed."""

    def __init__(self, *, rank: int, batch: int = 8, width: int = 16) -> None:
        self.index = 0
        self._rank = rank
        self._batch = batch
        self._width = width

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.index * 1009 + self._rank)
        self.index += 1
        x = torch.randn(self._batch, self._width, generator=generator)
        return x, x.sum(dim=1, keepdim=True)

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.index = int(state_dict["index"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--step-delay", type=float, default=0.0)
    args = parser.parse_args()

    cfg = runtime_config.from_env()  # what the operator asked for (defaults elsewhere)
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    mesh = device_mesh.init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    sampler = Sampler(rank=rank)
    train_state = state.TrainState()
    objects = {
        "model": state.ModelOptimizerState(model, optimizer),
        "lr_scheduler": scheduler,
        "rng": state.RNGState(),
        "data": sampler,
        "train": train_state,
    }
    with manager.CheckpointManager(cfg.checkpoint) as ckpt:
        ckpt.install_sigterm_handler()
        if cfg.resume.kind != "none":
            ckpt.restore(
                objects,
                step=cfg.resume.step,
                uri=cfg.resume.uri,
                key_map=cfg.import_keys,
                sha256=cfg.resume.sha256,
            )
        ckpt.report_step(train_state.step)
        while train_state.step < args.steps:
            x, y = sampler.next_batch()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            ckpt.wait_until_staged()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            train_state.step += 1
            if rank == 0:
                print(f"step {train_state.step} loss {loss.item():.5f}", flush=True)
            time.sleep(args.step_delay)
            ckpt.save(train_state.step, objects)
            if ckpt.reached_final(train_state.step):
                raise SystemExit(PREEMPTED)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    # Not SystemExit: interpreter finalization can race torch's gloo threads
    # into an abort after the last step (docs/trainer.md, exit_process).
    process_exit.exit_process(main())
