"""Benchmark of the async checkpoint writer against its baselines, side by side.

One run, 2 ranks (gloo on CPU), an FSDP2 model with AdamW (default 201M
parameters; `--layers 4 --dim 2048` is the 17M size), the real S3 server
(SeaweedFS on loopback). Every anchor is measured in the same run. Prints
(* = headline) and records in `bench/results/checkpoint-<size>-<UTC>.json`
(`bench/record.py`: versions, load average at start and end, seed, each
figure and ratio):

- training-blocking time of a save (save() + wait_until_staged() after one
  training step) / the same for `dcp.async_save` with DCP's own
  pinned/async stager (*), and / a synchronous `dcp.save` (target <= 0.05);
- write throughput of the writer's write phase (DCP write, CRC32C counted
  while written, one fsync per file) / a raw parallel write of the same
  bytes with the writer's thread count into a new folder, each file and the
  folder fsynced (* target >= 0.8), and / one raw sequential stream;
- the write phase before (DCP fsync, then a read-back CRC32C pass) and
  after (one pass), alternating on the same state;
- upload throughput, each step's bytes counted once / boto3 upload_file
  file by file (target >= 2) and / the best raw parallel PUT (>= 0.8);
- the `asyncMode` rows (no S3, second save) / sync dcp.save;
- with `--signing`: write + commit seconds with manifest signing / without
  (target <= 1.02).

Usage: PYTHONPATH=api:operator:trainer_image:devcluster python bench/checkpoint.py
       [--layers 12] [--dim 4096] [--workdir DIR] [--signing] [--seed 0]
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import operator
import os
import pathlib
import shutil
import statistics
import tempfile
import time
import typing

import ckpt_baselines  # bench/, next to this script
import ranks
import record
import torch
import torch.distributed as dist
from torch.distributed import fsdp
from torch.distributed.checkpoint import filesystem, state_dict_saver
from torch.distributed.device_mesh import init_device_mesh

from cairn.checkpoint import events, layout, manager, options, state
from cairn.devcluster import standalone_s3

RANKS = 2


def rank_main(cfg: dict[str, typing.Any]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    work = pathlib.Path(cfg["workdir"])
    torch.manual_seed(cfg["seed"])
    model = torch.nn.Sequential(
        *[torch.nn.Linear(cfg["dim"], cfg["dim"], bias=False) for _ in range(cfg["layers"])]
    )
    params = sum(p.numel() for p in model.parameters())
    mesh = init_device_mesh("cpu", (RANKS,))
    for layer in model:
        fsdp.fully_shard(layer, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def forward_backward() -> None:
        torch.autograd.backward(model(torch.randn(4, cfg["dim"])).square().mean())

    forward_backward()
    optim.step()
    optim.zero_grad()
    objects: dict[str, state.Stateful] = {"model_optim": state.ModelOptimizerState(model, optim)}
    result: dict[str, typing.Any] = {
        "rank": rank,
        "params": params,
        "write_threads": cfg["write_threads"],
    }

    # Baseline 1: synchronous dcp.save (blocks training for all of it).
    group = dist.new_group(backend="gloo")
    dist.barrier()
    t0 = time.monotonic()
    snapshot = {"model_optim": objects["model_optim"].state_dict()}
    state_dict_saver.save(
        snapshot,
        storage_writer=filesystem.FileSystemWriter(work / "sync", sync_files=True),
        process_group=group,
    )
    result["sync_block_s"] = time.monotonic() - t0
    del snapshot
    dist.barrier()

    # Baseline 2: raw writes of the same bytes, measured below right before
    # each idle save of the writer (this machine's load moves; adjacent
    # measurements share it).
    nbytes = sum(p.stat().st_size for p in (work / "sync").glob(f"__{rank}_*"))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(work / "sync", ignore_errors=True)
    result["raw_write"] = {"bytes": nbytes}

    # The writer: two saves with a training step to overlap (the first
    # allocates the staging buffers), then idle rounds: raw writes of the
    # same bytes, then a save with nothing to overlap (trainer idle).
    seen: list[events.ProgressEvent] = []
    opts = options.CheckpointOptions(
        directory=work / "async",
        s3=options.S3Options(**cfg["s3"]),
        keep_last=2,
        timeout_seconds=1200,
        write_threads=cfg["write_threads"],
    )
    saves: list[dict[str, typing.Any]] = []
    with manager.CheckpointManager(opts, callbacks=[seen.append]) as ckpt:
        for step in (1, 2):
            dist.barrier()
            t0 = time.monotonic()
            ckpt.save(step, objects, force=True)
            save_s = time.monotonic() - t0
            forward_backward()  # the next training step overlaps staging
            t1 = time.monotonic()
            ckpt.wait_until_staged()
            wait_s = time.monotonic() - t1
            optim.step()
            optim.zero_grad()
            t2 = time.monotonic()
            ckpt.wait_until_finished()
            saves.append(
                {"save_s": save_s, "wait_staged_s": wait_s, "finish_s": time.monotonic() - t2}
            )
        for step in range(3, 3 + cfg["idle_rounds"]):
            raw = ckpt_baselines.raw_writes(
                work, rank=rank, nbytes=nbytes, threads=cfg["write_threads"]
            )
            dist.barrier()
            t0 = time.monotonic()
            ckpt.save(step, objects, force=True)
            ckpt.wait_until_staged()
            saves.append({"step": step, "no_overlap_block_s": time.monotonic() - t0, "raw": raw})
            ckpt.wait_until_finished()
    result["saves"] = saves
    last = layout.step_dir(opts.directory, 2 + cfg["idle_rounds"])
    result["last_step_files"] = [str(last / f.path) for f in layout.read_manifest(last).files]

    # The write phase before (DCP fsync + read-back CRC32C) and after (one pass).
    snapshot = {"model_optim": objects["model_optim"].state_dict()}
    result["write_phase"] = ckpt_baselines.write_phase_old_new(
        work, snapshot, rank=rank, threads=cfg["write_threads"], group=group, rounds=2
    )
    del snapshot
    result["modes"] = async_mode_rows(opts, objects, forward_backward, optim, work)
    # The stall anchor doing the same job: dcp.async_save, DCP's own stager.
    result["async_save"] = ckpt_baselines.async_save_rows(
        work,
        objects,
        forward_backward=forward_backward,
        optim=optim,
        group=group,
        threads=cfg["write_threads"],
    )
    if cfg["signing"]:
        result["signing"] = ckpt_baselines.signing_rows(
            opts, objects, work, rounds=cfg["signing_rounds"]
        )
    result["events"] = [
        {"phase": e.phase, "step": e.step, "seconds": e.seconds, "bytes": e.bytes, "msg": e.message}
        for e in seen
    ]
    (work / f"result-{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def async_mode_rows(
    opts: options.CheckpointOptions,
    objects: dict[str, state.Stateful],
    forward_backward: typing.Callable[[], None],
    optim: torch.optim.Optimizer,
    work: pathlib.Path,
) -> dict[str, float]:
    """Blocking seconds of each asyncMode: save() + wait_until_staged(), with
    a training step to overlap, second save (buffers allocated), no S3."""
    rows: dict[str, float] = {}
    for mode in ("pinned", "thread", "off"):
        mode_opts = dataclasses.replace(
            opts, directory=work / f"mode-{mode}", async_mode=mode, s3=None
        )
        with manager.CheckpointManager(mode_opts) as ckpt:
            for step in (1, 2):
                dist.barrier()
                t0 = time.monotonic()
                ckpt.save(step, objects, force=True)
                save_s = time.monotonic() - t0
                forward_backward()
                t1 = time.monotonic()
                ckpt.wait_until_staged()
                rows[mode] = save_s + time.monotonic() - t1
                optim.step()
                optim.zero_grad()
                ckpt.wait_until_finished()
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(work / f"mode-{mode}", ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--workdir", type=pathlib.Path, default=None)
    parser.add_argument("--write-threads", type=int, default=2)
    parser.add_argument("--s3-concurrency", type=int, default=8, help="per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--idle-rounds", type=int, default=3, help="raw write + idle save")
    parser.add_argument(
        "--signing", action="store_true", help="also write + commit with and without signing"
    )
    parser.add_argument(
        "--signing-rounds",
        type=int,
        default=2,
        help="saves of each kind for --signing (the write phase varies more than 2%%)",
    )
    parser.add_argument("--rank-config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_config:
        rank_main(json.loads(pathlib.Path(args.rank_config).read_text()))
        return

    env = record.environment()
    work = args.workdir or pathlib.Path(tempfile.mkdtemp(prefix="cairn-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    server = standalone_s3.start(root=work / "s3", s3_port=ranks.free_port() // 2 + 10000)
    try:
        bucket = server.new_bucket("bench")
        cfg = {
            "workdir": str(work),
            "layers": args.layers,
            "dim": args.dim,
            "write_threads": args.write_threads,
            "seed": args.seed,
            "idle_rounds": args.idle_rounds,
            "signing": args.signing,
            "signing_rounds": args.signing_rounds,
            "s3": {
                "uri": f"s3://{bucket}/bench",
                "endpoint_url": server.endpoint_url,
                "region": server.region,
                "access_key": server.access_key,
                "secret_key": server.secret_key,
                "concurrency": args.s3_concurrency,
            },
        }
        results = ranks.run_ranks(
            __file__,
            cfg,
            work=work,
            ranks=RANKS,
            extra_env={"TORCHINDUCTOR_CACHE_DIR": str(work / "inductor")},
        )
        upload_file, raw_rates = ckpt_baselines.upload_baselines(cfg, results[0]["last_step_files"])
        params = {k: v for k, v in cfg.items() if k not in ("workdir", "s3")}
        params["s3_concurrency"] = args.s3_concurrency
        report(results, upload_file, raw_rates, env=env, params=params)
    finally:
        server.stop()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


Row = tuple[str, str, float, float, str]
"""(key, label, ours, baseline, target) of one printed and recorded figure."""


def _phase(results: list[dict[str, typing.Any]], name: str, step: int) -> tuple[int, float]:
    """(bytes of the step counted once, slowest rank's seconds) of one writer phase.

    Bytes come from the `written` events (each rank's own files, summed):
    rank 0's `uploaded` event already stands for the whole step, so summing
    `uploaded` events would count a step 1.5-2x."""
    written = [
        e for r in results for e in r["events"] if e["phase"] == "written" and e["step"] == step
    ]
    found = [e for r in results for e in r["events"] if e["phase"] == name and e["step"] == step]
    return sum(e["bytes"] for e in written), max(e["seconds"] for e in found)


def rows_of(
    results: list[dict[str, typing.Any]], upload_file: dict[str, float], raw_rates: dict[int, float]
) -> tuple[list[Row], dict[str, typing.Any]]:
    """Every figure with its anchor, measured in this one run, and the
    per-round figures the medians come from. Pure."""
    mb = 1024 * 1024
    sync_block = max(r["sync_block_s"] for r in results)
    async_block = max(r["async_save"][1]["block_s"] for r in results)
    block = max(r["saves"][1]["save_s"] + r["saves"][1]["wait_staged_s"] for r in results)
    first = max(r["saves"][0]["save_s"] + r["saves"][0]["wait_staged_s"] for r in results)
    idle = [{"ranks": saves} for saves in zip(*(r["saves"][2:] for r in results), strict=True)]
    no_overlap = statistics.median(max(s["no_overlap_block_s"] for s in i["ranks"]) for i in idle)
    step_bytes, _ = _phase(results, "written", 3)
    raw_bytes = sum(r["raw_write"]["bytes"] for r in results)
    threads = results[0]["write_threads"]
    # Each idle round: the writer's write phase and the raw writes just before it.
    rounds = []
    for i in idle:
        step = i["ranks"][0]["step"]
        wbytes, wsec = _phase(results, "written", step)
        rounds.append(
            {
                "ours": wbytes / wsec / mb,
                "parallel": raw_bytes / max(s["raw"]["parallel_s"] for s in i["ranks"]) / mb,
                "single": raw_bytes / max(s["raw"]["single_s"] for s in i["ranks"]) / mb,
            }
        )
    median = sorted(rounds, key=lambda r: r["ours"] / r["parallel"])[len(rounds) // 2]
    _, wsec_busy = _phase(results, "written", 2)

    def best(key: str, kind: str) -> float:
        per_round = zip(*(r[key][kind] for r in results), strict=True)
        return float(min(max(per_rank) for per_rank in per_round))

    old_rate = step_bytes / best("write_phase", "old") / mb
    new_rate = step_bytes / best("write_phase", "new") / mb
    upload_rates = [
        operator.truediv(*_phase(results, "uploaded", step)) / mb
        for step in range(2, 3 + len(idle))
    ]
    up_rate = statistics.median(upload_rates)
    best_threads = max(raw_rates, key=lambda t: raw_rates[t])
    rows: list[Row] = [
        (
            "stall_vs_async_save",
            "blocking s: save vs dcp.async_save (DCP stager) *",
            block,
            async_block,
            "",
        ),
        ("stall_vs_sync", "blocking s: save vs sync dcp.save", block, sync_block, "<= 0.05"),
        (
            "stall_first_vs_sync",
            "blocking s: first save (allocates) vs sync dcp.save",
            first,
            sync_block,
            "",
        ),
        (
            "stall_no_overlap_vs_sync",
            "blocking s: nothing to overlap vs sync dcp.save",
            no_overlap,
            sync_block,
            "",
        ),
        (
            "write_vs_raw_parallel",
            f"write MiB/s: writer vs raw parallel ({threads} thr) *",
            median["ours"],
            median["parallel"],
            ">= 0.8",
        ),
        (
            "write_vs_raw_single",
            "write MiB/s: writer vs raw single stream",
            median["ours"],
            median["single"],
            "",
        ),
        (
            "write_busy_vs_raw_parallel",
            "write MiB/s: writer, optimizer running, vs raw parallel",
            step_bytes / wsec_busy / mb,
            median["parallel"],
            "",
        ),
        (
            "write_phase_new_vs_old",
            "write phase MiB/s: one pass vs read-back",
            new_rate,
            old_rate,
            "",
        ),
        (
            "write_phase_cpu_new_vs_old",
            "write phase CPU s per rank: one pass vs read-back",
            best("write_phase", "new_cpu"),
            best("write_phase", "old_cpu"),
            "",
        ),
        (
            "write_phase_new_vs_raw_parallel",
            "write phase MiB/s: one pass vs raw parallel",
            new_rate,
            median["parallel"],
            ">= 0.8",
        ),
        (
            "write_phase_old_vs_raw_parallel",
            "write phase MiB/s: read-back vs raw parallel",
            old_rate,
            median["parallel"],
            "",
        ),
        (
            "upload_vs_upload_file",
            "upload MiB/s: writer vs upload_file 1 by 1",
            up_rate,
            upload_file["bytes"] / upload_file["seconds"] / mb,
            ">= 2",
        ),
        (
            "upload_vs_raw_put",
            f"upload MiB/s: writer vs raw parallel PUT ({best_threads} thr)",
            up_rate,
            raw_rates[best_threads] / mb,
            ">= 0.8",
        ),
    ]
    for mode in ("pinned", "thread", "off"):
        ours = max(r["modes"][mode] for r in results)
        target = "<= 0.05" if mode != "off" else ""
        rows.append(
            (
                f"mode_{mode}_vs_sync",
                f"blocking s: asyncMode={mode} vs sync dcp.save",
                ours,
                sync_block,
                target,
            )
        )
    if "signing" in results[0]:
        signed, unsigned = best("signing", "signed"), best("signing", "unsigned")
        rows.append(("signing", "write+commit s: signed vs unsigned", signed, unsigned, "<= 1.02"))
        sign_call = max(max(r["signing"]["sign_call"]) for r in results)
        rows.append(
            (
                "sign_call",
                "sign() s vs write phase s (one pass)",
                sign_call,
                best("write_phase", "new"),
                "<= 0.02",
            )
        )
    return rows, {"idle_rounds_mib_s": rounds, "upload_mib_s_by_step_from_2": upload_rates}


def report(
    results: list[dict[str, typing.Any]],
    upload_file: dict[str, float],
    raw_rates: dict[int, float],
    *,
    env: dict[str, typing.Any],
    params: dict[str, typing.Any],
) -> None:
    """Print every figure side by side and write the run's JSON record."""
    mb = 1024 * 1024
    rows, detail = rows_of(results, upload_file, raw_rates)
    step_bytes, _ = _phase(results, "written", 3)
    print(f"model: {results[0]['params'] / 1e6:.0f}M params + AdamW, {RANKS} ranks (gloo, CPU)")
    print(f"checkpoint bytes per step: {step_bytes / mb:.0f} MiB; * = headline")
    print(f"load average at start: {env['load_average_start']}, now: {list(os.getloadavg())}")
    print()
    print(f"{'metric':<56}{'ours':>10}{'baseline':>10}{'ratio':>8}{'target':>9}")
    for _, label, ours, base, target in rows:
        print(f"{label:<56}{ours:>10.3f}{base:>10.3f}{ours / base:>8.3f}{target:>9}")
    print()
    print("raw parallel PUT MiB/s by threads:", {t: round(r / mb, 1) for t, r in raw_rates.items()})
    split = [e["msg"] for r in results for e in r["events"] if e["phase"] == "written"]
    print(
        "idle rounds, MiB/s:",
        [{k: round(v) for k, v in r.items()} for r in detail["idle_rounds_mib_s"]],
    )
    print("upload MiB/s by step:", [round(r) for r in detail["upload_mib_s_by_step_from_2"]])
    print("write phase split:", split)
    figures = {
        key: {
            "label": label,
            "ours": ours,
            "baseline": base,
            "ratio": ours / base,
            "target": target,
        }
        for key, label, ours, base, target in rows
    }
    path = record.write(
        bench="checkpoint",
        tag=f"{results[0]['params'] / 1e6:.0f}M",
        env=env,
        params={**params, "model_params": results[0]["params"], "bytes_per_step": step_bytes},
        figures={
            "rows": figures,
            **detail,
            "raw_put_mib_s": {str(t): r / mb for t, r in raw_rates.items()},
            "upload_file": upload_file,
            "write_phase_split": split,
            "per_rank": [{k: v for k, v in r.items() if k != "last_step_files"} for r in results],
        },
    )
    print(f"record: {path.relative_to(pathlib.Path(__file__).resolve().parent.parent)}")


if __name__ == "__main__":
    main()
