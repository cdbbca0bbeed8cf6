"""On one GPU: the step-time dip of a checkpoint save, Cairn's writer vs DCP's own.

    python bench/save_dip_gpu.py [--layers 4] [--dim 8192] [--steps 60] [--every 20]
                                 [--workdir DIR] [--out result.json]

One process, one CUDA device, world size 1 (``cpu:gloo,cuda:nccl``), a stack
of fp32 ``Linear`` layers with AdamW (``--layers 4 --dim 8192``: 268M
parameters, 3.2 GB of state). The training loop is the reference trainer's:
forward + backward, ``wait_until_staged()``, ``optimizer.step()``, then
``save()`` every ``--every`` steps. Side by side in one run, each over the
same ``--steps`` steps after a warm-up:

- ``none``: no checkpoint (the step time to compare against);
- ``cairn``: ``CheckpointManager`` (``asyncMode: pinned``, local volume only);
- ``dcp_async``: ``dcp.async_save`` with DCP's pinned, async ``DefaultStager``
  (the strongest stock anchor), the same loop, waiting for its staging
  before the next ``optimizer.step()`` and for its previous save before the
  next one (at most one in flight, as ours);
- ``dcp_sync``: one synchronous ``dcp.save`` (what a save costs when it blocks).

Each step is timed to the end of its GPU work (``torch.cuda.synchronize``).
Printed and written as JSON: median step time without saves, the time of the
step that saved and of the one after it, the extra seconds all saves cost
over the run (sum of step times - steps x the ``none`` median), the save
call's blocking seconds. Needs torch with CUDA, and Cairn's trainer package
(``PYTHONPATH=api:trainer_image``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import filesystem, staging, state_dict_saver

from cairn.checkpoint import inflight, manager, options, state


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Trainer:
    def __init__(self, *, layers: int, dim: int, tokens: int, device: str) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            *[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)]
        ).to(device)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.batch = torch.randn(tokens, dim, device=device)
        self.objects: dict[str, state.Stateful] = {
            "model_optim": state.ModelOptimizerState(self.model, self.optim)
        }
        self.params = sum(p.numel() for p in self.model.parameters())

    def forward_backward(self) -> None:
        self.model(self.batch).square().mean().backward()

    def optimizer_step(self) -> None:
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)


def _loop(
    trainer: Trainer,
    *,
    steps: int,
    every: int,
    wait_staged: Callable[[], None],
    save: Callable[[int], float] | None,
) -> dict[str, Any]:
    """Time each step (to the end of its GPU work); `save(step)` returns its blocking s."""
    times: list[float] = []
    blocks: list[float] = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        trainer.forward_backward()
        wait_staged()
        trainer.optimizer_step()
        if save is not None and step % every == 0:
            blocks.append(save(step))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    saved = [i for i in range(steps) if save is not None and (i + 1) % every == 0]
    quiet = [t for i, t in enumerate(times) if i not in saved and i - 1 not in saved]
    return {
        "step_s": times,
        "median_quiet_step_s": statistics.median(quiet) if quiet else None,
        "save_step_s": [times[i] for i in saved],
        "after_save_step_s": [times[i + 1] for i in saved if i + 1 < steps],
        "save_block_s": blocks,
        "total_s": sum(times),
    }


def _cairn(trainer: Trainer, work: pathlib.Path, *, steps: int, every: int) -> dict[str, Any]:
    opts = options.CheckpointOptions(
        directory=work / "cairn", keep_last=2, async_mode="pinned", timeout_seconds=1200
    )
    with manager.CheckpointManager(opts) as ckpt:

        def save(step: int) -> float:
            t0 = time.perf_counter()
            ckpt.save(step, trainer.objects, force=True)
            return time.perf_counter() - t0

        out = _loop(
            trainer, steps=steps, every=every, wait_staged=ckpt.wait_until_staged, save=save
        )
        t0 = time.perf_counter()
        ckpt.wait_until_finished()
        out["drain_s"] = time.perf_counter() - t0
    shutil.rmtree(work / "cairn", ignore_errors=True)
    return out


def _dcp_async(trainer: Trainer, work: pathlib.Path, *, steps: int, every: int) -> dict[str, Any]:
    stager = staging.DefaultStager(
        staging.StagingOptions(
            use_pinned_memory=True,
            use_shared_memory=False,
            use_async_staging=True,
            use_non_blocking_copy=torch.cuda.is_available(),  # raises without one
        )
    )
    # The same torch < 2.15 fix as ours, or its second save fails there.
    inflight.keep_copiers_between_stages(stager)
    pending: list[Any] = []

    def wait_staged() -> None:
        if pending:
            pending[-1].staging_completion.result()

    def save(step: int) -> float:
        t0 = time.perf_counter()
        if pending:  # at most one in flight, as Cairn
            pending.pop().upload_completion.result()
        response = state_dict_saver.async_save(
            {"model_optim": trainer.objects["model_optim"].state_dict()},
            storage_writer=filesystem.FileSystemWriter(work / f"dcp-{step}", sync_files=True),
            async_stager=stager,
        )
        pending.append(response)
        return time.perf_counter() - t0

    try:
        out = _loop(trainer, steps=steps, every=every, wait_staged=wait_staged, save=save)
        t0 = time.perf_counter()
        for response in pending:
            response.upload_completion.result()
        out["drain_s"] = time.perf_counter() - t0
    finally:
        stager.close()
    for folder in work.glob("dcp-*"):
        shutil.rmtree(folder, ignore_errors=True)
    return out


def _dcp_sync(trainer: Trainer, work: pathlib.Path) -> float:
    t0 = time.perf_counter()
    state_dict_saver.save(
        {"model_optim": trainer.objects["model_optim"].state_dict()},
        storage_writer=filesystem.FileSystemWriter(work / "sync", sync_files=True),
    )
    seconds = time.perf_counter() - t0
    shutil.rmtree(work / "sync", ignore_errors=True)
    return seconds


def _summary(name: str, row: dict[str, Any], none_median: float) -> dict[str, Any]:
    steps = len(row["step_s"])
    extra = row["total_s"] - steps * none_median
    out = {
        "median_quiet_step_s": row["median_quiet_step_s"],
        "save_step_s_median": statistics.median(row["save_step_s"]) if row["save_step_s"] else None,
        "after_save_step_s_median": (
            statistics.median(row["after_save_step_s"]) if row["after_save_step_s"] else None
        ),
        "save_block_s_median": (
            statistics.median(row["save_block_s"]) if row["save_block_s"] else None
        ),
        "extra_s_over_run": extra,
        "dip_fraction": extra / (steps * none_median),
        "drain_s": row.get("drain_s"),
    }
    print(
        f"{name:<10} quiet step {out['median_quiet_step_s'] * 1e3:8.1f} ms  "
        f"save step {(out['save_step_s_median'] or 0) * 1e3:8.1f} ms  "
        f"next {(out['after_save_step_s_median'] or 0) * 1e3:8.1f} ms  "
        f"blocking {(out['save_block_s_median'] or 0) * 1e3:8.1f} ms  "
        f"run +{extra:6.2f} s ({out['dip_fraction'] * 100:5.1f}%)",
        flush=True,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/save_dip_gpu.py")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--workdir", type=pathlib.Path, default=None)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument("--cpu", action="store_true", help="a dry run of the code on CPU")
    args = parser.parse_args(argv)
    if not (args.cpu or torch.cuda.is_available()):
        raise SystemExit("save_dip_gpu: needs a CUDA device (or --cpu for a dry run)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo" if args.cpu else "cpu:gloo,cuda:nccl", rank=0, world_size=1)
    device = "cpu" if args.cpu else "cuda"
    if not args.cpu:
        torch.cuda.set_device(0)
    work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="save-dip-"))
    trainer = Trainer(layers=args.layers, dim=args.dim, tokens=args.tokens, device=device)
    name = "cpu" if args.cpu else torch.cuda.get_device_name(0)
    state_bytes = sum(p.numel() * p.element_size() * 3 for p in trainer.model.parameters())
    print(
        f"{name}: {trainer.params / 1e6:.0f}M params, ~{state_bytes / 2**30:.1f} GiB of state",
        flush=True,
    )
    _loop(trainer, steps=5, every=args.every, wait_staged=lambda: None, save=None)  # warm-up
    rows: dict[str, dict[str, Any]] = {}
    rows["none"] = _loop(
        trainer, steps=args.steps, every=args.every, wait_staged=lambda: None, save=None
    )
    rows["cairn"] = _cairn(trainer, work, steps=args.steps, every=args.every)
    rows["dcp_async"] = _dcp_async(trainer, work, steps=args.steps, every=args.every)
    sync_s = _dcp_sync(trainer, work)
    none_median = rows["none"]["median_quiet_step_s"]
    summary = {name: _summary(name, row, none_median) for name, row in rows.items()}
    print(f"dcp_sync   blocking {sync_s:.2f} s", flush=True)
    cairn, anchor = summary["cairn"], summary["dcp_async"]
    ratios = {
        "blocking_cairn_vs_dcp_async": cairn["save_block_s_median"] / anchor["save_block_s_median"],
        "blocking_cairn_vs_dcp_sync": cairn["save_block_s_median"] / sync_s,
        "run_extra_cairn_vs_dcp_async": (
            cairn["extra_s_over_run"] / anchor["extra_s_over_run"]
            if anchor["extra_s_over_run"] > 0
            else None
        ),
    }
    print(json.dumps(ratios, indent=2))
    result = {
        "bench": "save_dip_gpu",
        "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": name,
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda},
        "params": {**{k: str(v) for k, v in vars(args).items()}, "model_params": trainer.params},
        "state_bytes": state_bytes,
        "load_average": list(os.getloadavg()),
        "summary": summary,
        "dcp_sync_block_s": sync_s,
        "ratios": ratios,
        "rows": rows,
    }
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    dist.destroy_process_group()
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
