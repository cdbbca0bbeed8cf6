"""Thread writer vs process writer, side by side: what a background save costs training.

One run, 2 ranks (gloo on CPU), an FSDP2 model with AdamW. For each writer
kind, in the same processes and on the same model:

- ``ours``: the CheckpointManager (thread writer: DCP write + CRC32C + fsync +
  commit, local only);
- ``dcp-thread``: ``dcp.async_save`` with ``AsyncCheckpointerType.THREAD``;
- ``dcp-process``: ``dcp.async_save`` with ``AsyncCheckpointerType.PROCESS``
  (a checkpoint daemon process per rank, the state staged to shared memory).

it measures the training-blocking seconds of a save (call until training
may mutate the weights again) and the mean training-step time while the
write runs in the background, as a ratio to the mean of the steps just
before that save (1.0 = free). Each kind saves three times; the first save of each kind
is a warm-up (buffer allocation, daemon start) and is reported separately.
The figures go to `bench/results/writer_kind-<size>-<UTC>.json` (`bench/record.py`).

Usage: PYTHONPATH=api:operator:trainer_image:devcluster python bench/writer_kind.py
       [--layers 12] [--dim 2048] [--saves 3]
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import tempfile
import time
import typing

import ranks  # bench/, next to this script
import record
import torch
import torch.distributed as dist
from torch.distributed import fsdp
from torch.distributed.checkpoint import filesystem, state_dict_saver
from torch.distributed.device_mesh import init_device_mesh

from cairn.checkpoint import events, manager, options, state

RANKS = 2
KINDS = ("ours", "dcp-thread", "dcp-process")


class Trainer:
    def __init__(self, cfg: dict[str, typing.Any]) -> None:
        torch.manual_seed(0)
        self.dim = cfg["dim"]
        self.model = torch.nn.Sequential(
            *[torch.nn.Linear(self.dim, self.dim, bias=False) for _ in range(cfg["layers"])]
        )
        self.params = sum(p.numel() for p in self.model.parameters())
        mesh = init_device_mesh("cpu", (RANKS,))
        for layer in self.model:
            fsdp.fully_shard(layer, mesh=mesh)
        fsdp.fully_shard(self.model, mesh=mesh)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.batch = cfg["batch"]

    def step(self) -> float:
        t0 = time.monotonic()
        loss = self.model(torch.randn(self.batch, self.dim)).square().mean()
        torch.autograd.backward(loss)
        self.optim.step()
        self.optim.zero_grad()
        return time.monotonic() - t0


def steps_while(trainer: Trainer, done: typing.Callable[[], bool], limit: int) -> list[float]:
    """Train until the background save is done (every rank agrees); step times."""
    times: list[float] = []
    flag = torch.zeros(1)
    while len(times) < limit:
        times.append(trainer.step())
        flag[0] = 1.0 if done() else 0.0
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag[0] == 1.0:
            break
    return times


def rank_main(cfg: dict[str, typing.Any]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    work = pathlib.Path(cfg["workdir"])
    trainer = Trainer(cfg)
    trainer.step()
    # Saves never share the training group (a deadlock otherwise: docs/architecture.md, "Write").
    group = dist.new_group(backend="gloo")
    assert isinstance(group, dist.ProcessGroup)
    objects: dict[str, state.Stateful] = {
        "model_optim": state.ModelOptimizerState(trainer.model, trainer.optim)
    }
    results: dict[str, typing.Any] = {
        "rank": rank,
        "params": trainer.params,
    }
    for kind in cfg["kinds"]:
        saves: list[dict[str, typing.Any]] = []
        if kind == "ours":
            opts = options.CheckpointOptions(
                directory=work / kind, keep_last=2, timeout_seconds=1200
            )
            seen: list[events.ProgressEvent] = []
            with manager.CheckpointManager(opts, callbacks=[seen.append]) as ckpt:
                for n in range(cfg["saves"]):
                    idle = [trainer.step() for _ in range(cfg["idle_steps"])]
                    dist.barrier()
                    t0 = time.monotonic()
                    ckpt.save(n + 1, objects, force=True)
                    ckpt.wait_until_staged()
                    block = time.monotonic() - t0

                    def finished(step: int = n + 1, got: list[events.ProgressEvent] = seen) -> bool:
                        return any(
                            e.step == step and e.phase in ("finished", "failed") for e in got
                        )

                    busy = steps_while(trainer, finished, cfg["max_steps"])
                    t1 = time.monotonic()
                    ckpt.wait_until_finished()
                    saves.append(
                        {
                            "block_s": block,
                            "idle_steps": idle,
                            "busy_steps": busy,
                            "tail_s": time.monotonic() - t1,
                        }
                    )
        else:
            checkpointer = (
                state_dict_saver.AsyncCheckpointerType.PROCESS
                if kind == "dcp-process"
                else state_dict_saver.AsyncCheckpointerType.THREAD
            )
            for n in range(cfg["saves"]):
                idle = [trainer.step() for _ in range(cfg["idle_steps"])]
                dist.barrier()
                t0 = time.monotonic()
                snapshot = {"model_optim": objects["model_optim"].state_dict()}
                future = state_dict_saver.async_save(
                    snapshot,
                    storage_writer=filesystem.FileSystemWriter(
                        work / kind / f"step-{n + 1}", sync_files=True
                    ),
                    process_group=group,
                    async_checkpointer_type=checkpointer,
                )
                block = time.monotonic() - t0
                assert not isinstance(future, state_dict_saver.AsyncSaveResponse)
                busy = steps_while(trainer, future.done, cfg["max_steps"])
                t1 = time.monotonic()
                future.result()
                saves.append(
                    {
                        "block_s": block,
                        "idle_steps": idle,
                        "busy_steps": busy,
                        "tail_s": time.monotonic() - t1,
                    }
                )
                del snapshot
        results[kind] = saves
        dist.barrier()
        shutil.rmtree(work / kind, ignore_errors=True)
    (work / f"result-{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def report(results: list[dict[str, typing.Any]], kinds: list[str]) -> dict[str, typing.Any]:
    """Print the table; returns its figures by writer kind."""
    print(f"model: {results[0]['params'] / 1e6:.0f}M params + AdamW, {RANKS} ranks (gloo, CPU)")
    print("busy/idle: mean step time while the save is written / mean of the steps just before")
    print()
    header = f"{'writer':<14}{'first block s':>14}{'block s':>10}{'busy/idle':>11}"
    print(f"{header}{'idle step s':>13}{'busy steps':>12}")
    figures: dict[str, typing.Any] = {}
    for kind in kinds:
        per_save = list(zip(*(r[kind] for r in results), strict=True))
        blocks = [max(s["block_s"] for s in saves) for saves in per_save]
        steady = per_save[1:] or per_save
        idle = [t for saves in steady for s in saves for t in s["idle_steps"]]
        busy = [t for saves in steady for s in saves for t in s["busy_steps"]]
        ratio = statistics.mean(busy) / statistics.mean(idle)
        steady_block = statistics.mean(blocks[1:] or blocks)
        print(
            f"{kind:<14}{blocks[0]:>14.3f}{steady_block:>10.3f}{ratio:>11.2f}"
            f"{statistics.mean(idle):>13.3f}{len(busy):>12}"
        )
        figures[kind] = {
            "first_block_s": blocks[0],
            "block_s": steady_block,
            "busy_over_idle": ratio,
            "idle_step_s": statistics.mean(idle),
            "busy_steps": len(busy),
        }
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--idle-steps", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--workdir", type=pathlib.Path, default=None)
    parser.add_argument("--rank-config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_config:
        rank_main(json.loads(pathlib.Path(args.rank_config).read_text()))
        return
    kinds = args.kinds.split(",")
    env = record.environment()
    work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="cairn-bench-writer-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        cfg = {
            "workdir": str(work),
            "layers": args.layers,
            "dim": args.dim,
            "batch": args.batch,
            "saves": args.saves,
            "idle_steps": args.idle_steps,
            "max_steps": args.max_steps,
            "kinds": kinds,
        }
        results = ranks.run_ranks(__file__, cfg, work=work, ranks=RANKS)
        figures = report(results, kinds)
        params = {k: v for k, v in cfg.items() if k != "workdir"}
        path = record.write(
            bench="writer_kind",
            tag=f"{results[0]['params'] / 1e6:.0f}M",
            env=env,
            params={**params, "model_params": results[0]["params"], "seed": 0},
            figures={"kinds": figures, "per_rank": results},
        )
        print(f"record: {path}")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
