"""A tiny deterministic FSDP2 trainer used by the checkpoint tests (one rank).

Run by `ckpt_harness` as one process per rank (gloo on CPU, env:// init).
The config (JSON file, argv[1]) says how many steps to train, when to save,
whether to resume, and where to write results: per-rank JSON (losses,
restore result, steps trained while a save was in flight) and full-state
dumps (`dump-<tag>-rank<r>.pt`) that the tests compare bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import sys
import time
import typing

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import fsdp
from torch.distributed.checkpoint import state_dict as dcp_state_dict
from torch.distributed.device_mesh import init_device_mesh

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import layout, options, process_exit, state
from cairn.checkpoint import manager as manager_mod

DIM = 16
BATCH = 4


class DataPosition:
    """A global data cursor (same on every rank), like a stateful sampler."""

    def __init__(self) -> None:
        self.index = 0

    def state_dict(self) -> dict[str, typing.Any]:
        return {"index": self.index}

    def load_state_dict(self, sd: dict[str, typing.Any]) -> None:
        self.index = int(sd["index"])


def batch(position: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + position)
    x = torch.randn(BATCH * world, DIM, generator=gen)[rank * BATCH : (rank + 1) * BATCH]
    y = x.sum(dim=1, keepdim=True)
    return x, y


def build_model(world: int, *, independent: bool = False) -> torch.nn.Module:
    """FSDP2 over all ranks; `independent`: a plain module per rank (no
    collectives while training, so ranks can run steps apart as with NCCL)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, 32),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(32, 1),
    )
    if not independent and (world > 1 or dist.is_initialized()):
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[3]):
            fsdp.fully_shard(layer, mesh=mesh)
        fsdp.fully_shard(model, mesh=mesh)
    return model


def full_state(
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    data: DataPosition,
    train: state.TrainState,
    sched: typing.Any = None,
) -> dict[str, typing.Any]:
    """Every state part a resume must restore (compared bit for bit by the tests)."""
    opts = dcp_state_dict.StateDictOptions(full_state_dict=True)
    model_sd, optim_sd = dcp_state_dict.get_state_dict(model, optim, options=opts)
    return {
        "model": {k: typing.cast(torch.Tensor, v).clone() for k, v in model_sd.items()},
        "optim": optim_sd,
        "sched": None if sched is None else sched.state_dict(),
        "rng_torch": torch.get_rng_state(),
        "rng_numpy": np.random.get_state(legacy=True)[1].copy(),  # type: ignore[index]
        "rng_python": random.getstate(),
        "data": data.index,
        "train": train.state_dict(),
    }


def main() -> None:
    cfg = json.loads(pathlib.Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dist.init_process_group("gloo")
    out = pathlib.Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1 + rank)
    np.random.seed(2 + rank)
    random.seed(3 + rank)
    model = build_model(world, independent=cfg.get("independent", False))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.9)
    data = DataPosition()
    train = state.TrainState()
    objects: dict[str, state.Stateful] = {
        "model_optim": state.ModelOptimizerState(model, optim),
        "lr_scheduler": sched,
        "rng": state.RNGState(),
        "data": data,
        "train": train,
    }
    s3 = options.S3Options(**cfg["s3"]) if cfg.get("s3") else None
    opts = options.CheckpointOptions(
        # "{rank}" in the directory gives every rank its own (node-local) volume.
        directory=pathlib.Path(cfg["dir"].format(rank=rank)),
        interval_steps=cfg.get("interval"),
        keep_last=cfg.get("keep_last", 3),
        keep_aside=cfg.get("keep_aside", 3),
        max_bytes=cfg.get("max_bytes"),
        async_mode=cfg.get("async_mode", "pinned"),
        upload_on_failure=cfg.get("upload_on_failure", "Continue"),
        final_grace_seconds=cfg.get("final_grace"),
        upload_retry_seconds=cfg.get("upload_retry", 2.0),
        attempt=cfg.get("attempt", 0),
        job_uid=cfg.get("job_uid"),
        # The job's keyring file content (as the operator's Secret holds it).
        manifest_keyring=manifest_mod.parse_keyring(cfg["keyring"]) if cfg.get("keyring") else None,
        s3=s3,
        timeout_seconds=cfg.get("timeout", 60.0),
        # "{rank}" again: every rank its own pod memory (the memory tier).
        memory_dir=pathlib.Path(cfg["memory_dir"].format(rank=rank))
        if cfg.get("memory_dir")
        else None,
        memory_replicas=cfg.get("memory_replicas", 1),
        upload_interval_steps=cfg.get("upload_interval"),
    )
    result: dict[str, typing.Any] = {"rank": rank, "losses": {}, "saved": []}
    # The process group's gloo threads, by the name torch gives them: the
    # manager's own group must be gone (joined) once its `with` block ends.
    result["gloo_threads_before"] = gloo_threads()
    dump_steps = set(cfg.get("dump_steps", []))
    seen: list[dict[str, typing.Any]] = []

    def record(event: typing.Any) -> None:
        if event.phase in (
            "upload_failed",
            "uploaded",
            "rotated",
            "committed",
            "deleted",
            "quarantined",
            "restore_fallback",
            "restored",
            "memory_kept",
            "memory_failed",
        ):
            seen.append(
                {
                    "phase": event.phase,
                    "step": event.step,
                    "rank": event.rank,
                    "message": event.message,
                    "time": time.time(),
                }
            )

    with manager_mod.CheckpointManager(opts, callbacks=[record]) as ckpt:
        if cfg.get("sigterm"):
            ckpt.install_sigterm_handler()
        if cfg.get("resume"):
            restored = ckpt.restore(objects, step=cfg.get("resume_step"), uri=cfg.get("resume_uri"))
            result["restored"] = None if restored is None else restored.step
            result["imported"] = None if restored is None else restored.imported
            result["skipped"] = [] if restored is None else [s for s, _ in restored.skipped]
            result["skipped_state"] = [] if restored is None else list(restored.skipped_state)
            result["downloaded"] = [] if restored is None else list(restored.downloaded)
            result["quarantined"] = [] if restored is None else list(restored.quarantined)
            result["tier"] = None if restored is None else restored.tier
            result["tiers"] = [] if restored is None else list(restored.tiers)
            torch.save(
                full_state(model, optim, data, train, sched), out / f"dump-restored-rank{rank}.pt"
            )
        pending_save: int | None = None
        steps_during_save = 0
        while train.step < cfg["steps"]:
            step = train.step + 1
            x, y = batch(data.index, rank, world)
            x = x + torch.from_numpy(np.random.randn(*x.shape).astype(np.float32)) * 0.01
            x = x * (1.0 + random.random() * 0.01)
            loss = torch.nn.functional.mse_loss(model(x), y)
            torch.autograd.backward(loss)
            ckpt.wait_until_staged()  # never mutate parameters under the stager
            optim.step()
            optim.zero_grad()
            sched.step()
            data.index += 1
            train.step = step
            train.tokens_seen += BATCH * world
            result["losses"][str(step)] = loss.item()
            result.setdefault("step_times", {})[str(step)] = time.time()
            if cfg.get("step_file"):  # the step this rank finished (before it may save)
                pathlib.Path(cfg["step_file"]).with_suffix(f".{rank}").write_text(str(step))
            if pending_save is not None:
                steps_during_save += 1
                if ckpt._inflight is None or ckpt._inflight.done.done():
                    result["steps_during_save"] = steps_during_save
                    pending_save = None
            if ckpt.should_save(step):
                if step in dump_steps:
                    torch.save(
                        full_state(model, optim, data, train, sched),
                        out / f"dump-{step}-rank{rank}.pt",
                    )
                if ckpt.save(step, objects):
                    result["saved"].append(step)
                    # Whether the step was committed the moment save() returned.
                    folder = layout.step_dir(opts.directory, step)
                    result.setdefault("committed_on_return", {})[str(step)] = (
                        folder / "manifest.json"
                    ).is_file()
                    # Committed steps on this rank's volume while a save is in flight.
                    result.setdefault("committed_during", []).append(
                        len(layout.committed_steps(opts.directory))
                    )
                    if step == cfg.get("measure_overlap_step"):
                        pending_save, steps_during_save = step, 0
            elif step in dump_steps:
                torch.save(
                    full_state(model, optim, data, train, sched), out / f"dump-{step}-rank{rank}.pt"
                )
            if step == 2 and cfg.get("progress_file"):
                pathlib.Path(cfg["progress_file"]).with_suffix(f".{rank}").write_text("2")
            hold = cfg.get("hold")  # {"rank": r, "after": step, "until": path[, "seconds": s]}
            if hold and hold["rank"] == rank and step == hold["after"]:
                until = pathlib.Path(hold["until"])
                deadline = time.monotonic() + hold.get("seconds", 60)
                while not until.exists() and time.monotonic() < deadline:
                    time.sleep(0.02)

            if ckpt.reached_final(step):
                result["final_step"] = step
                break
            time.sleep(cfg.get("sleep_per_step", 0.0))
        ckpt.wait_until_finished()
        result.setdefault("steps_during_save", steps_during_save)
        result["all_steps"] = ckpt.all_steps()
    result["gloo_threads_after"] = gloo_threads()
    result["events"] = seen
    (out / f"result-rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def gloo_threads() -> int:
    count = 0
    for task in pathlib.Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            count += (task / "comm").read_text().strip() == "pt_gloo_runloop"
    return count


if __name__ == "__main__":
    main()
    process_exit.exit_process(0)
