"""Benchmark of the async checkpoint writer against its baselines, side by side.

One run, 2 ranks (gloo on CPU), a >= 200M-parameter FSDP2 model with AdamW,
the real S3 server (SeaweedFS on loopback). Prints:

- training-blocking time of an async save (save() + wait_until_staged()
  after one training step) / blocking time of a synchronous dcp.save
  (target <= 0.05);
- background write throughput (DCP write + CRC32C + fsync of the writer
  phase) / raw sequential write of the same bytes to the same disk
  (target >= 0.8);
- upload throughput of the writer / boto3 upload_file file by file
  (target >= 2) and / the best raw parallel PUT rate (target >= 0.8);
- the `asyncMode` rows side by side (no S3, steady-state second save):
  blocking time of `pinned`, `thread` and `off` / sync dcp.save. `pinned`
  and `thread` differ only on a GPU (page-locked buffers, non-blocking
  copies on the staging stream); on CPU they are the same code path. `off`
  blocks until the local commit, like dcp.save (plus CRC32C and manifest).

Usage: PYTHONPATH=api:operator:trainer_image:devcluster python bench/checkpoint.py
       [--layers 12] [--dim 4096] [--workdir DIR]
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
import time
import typing

import boto3
import botocore.config
import ranks  # bench/ranks.py, next to this script
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
    torch.manual_seed(0)
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
    result: dict[str, typing.Any] = {"rank": rank, "params": params}

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

    # Baseline 2: raw sequential write of the same bytes (both ranks at once).
    nbytes = sum(p.stat().st_size for p in (work / "sync").glob(f"__{rank}_*"))
    buffer = bytearray(os.urandom(1024 * 1024) * 64)
    dist.barrier()
    t0 = time.monotonic()
    with open(work / f"raw-{rank}.bin", "wb") as stream:
        left = nbytes
        while left > 0:
            chunk = memoryview(buffer)[: min(left, len(buffer))]
            stream.write(chunk)
            left -= len(chunk)
        stream.flush()
        os.fsync(stream.fileno())
    raw_seconds = time.monotonic() - t0
    dist.barrier()
    result["raw_write"] = {"bytes": nbytes, "seconds": raw_seconds}
    shutil.rmtree(work / "sync", ignore_errors=True)
    dist.barrier()
    (work / f"raw-{rank}.bin").unlink()

    # The writer: two saves (the first allocates the staging buffers).
    seen: list[events.ProgressEvent] = []
    opts = options.CheckpointOptions(
        directory=work / "async",
        s3=options.S3Options(**cfg["s3"]),
        keep_last=2,
        timeout_seconds=1200,
        write_threads=cfg["write_threads"],
    )
    saves = []
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
        # Worst case: nothing to overlap with.
        dist.barrier()
        t0 = time.monotonic()
        ckpt.save(3, objects, force=True)
        ckpt.wait_until_staged()
        saves.append({"no_overlap_block_s": time.monotonic() - t0})
        ckpt.wait_until_finished()
    result["saves"] = saves
    result["modes"] = async_mode_rows(opts, objects, forward_backward, optim, work)
    result["events"] = [
        {"phase": e.phase, "step": e.step, "seconds": e.seconds, "bytes": e.bytes, "msg": e.message}
        for e in seen
    ]
    result["step2_files"] = [
        str(layout.step_dir(opts.directory, 2) / f.path)
        for f in layout.read_manifest(layout.step_dir(opts.directory, 2)).files
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


def upload_baselines(
    cfg: dict[str, typing.Any], files: list[str]
) -> tuple[dict[str, float], dict[int, float]]:
    s3 = {k: v for k, v in cfg["s3"].items() if k != "concurrency"}
    client = boto3.client(
        "s3",
        endpoint_url=s3["endpoint_url"],
        aws_access_key_id=s3["access_key"],
        aws_secret_access_key=s3["secret_key"],
        region_name=s3["region"],
    )
    bucket = s3["uri"][5:].split("/", 1)[0]
    total = sum(os.path.getsize(f) for f in files)
    t0 = time.monotonic()
    for i, path in enumerate(files):
        client.upload_file(path, bucket, f"baseline/upload_file/{i}")
    upload_file = {"bytes": total, "seconds": time.monotonic() - t0}

    body = os.urandom(16 * 1024 * 1024)
    count = max(8, min(total, 1024**3) // len(body))
    rates: dict[int, float] = {}
    for threads in (8, 16, 32):
        fast = boto3.client(
            "s3",
            endpoint_url=s3["endpoint_url"],
            aws_access_key_id=s3["access_key"],
            aws_secret_access_key=s3["secret_key"],
            region_name=s3["region"],
            config=botocore.config.Config(max_pool_connections=threads),
        )

        def put(i: int, fast: typing.Any = fast, threads: int = threads) -> None:
            fast.put_object(Bucket=bucket, Key=f"baseline/raw-{threads}/{i}", Body=body)

        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            list(pool.map(put, range(count)))
        rates[threads] = count * len(body) / (time.monotonic() - t0)
    return upload_file, rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--workdir", type=pathlib.Path, default=None)
    parser.add_argument("--write-threads", type=int, default=2)
    parser.add_argument("--s3-concurrency", type=int, default=8, help="per rank")
    parser.add_argument("--rank-config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_config:
        rank_main(json.loads(pathlib.Path(args.rank_config).read_text()))
        return

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
        upload_file, raw_rates = upload_baselines(cfg, results[0]["step2_files"])
        report(results, upload_file, raw_rates)
    finally:
        server.stop()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def report(
    results: list[dict[str, typing.Any]],
    upload_file: dict[str, float],
    raw_rates: dict[int, float],
) -> None:
    def phase(name: str, step: int) -> tuple[int, float]:
        found = [
            e for r in results for e in r["events"] if e["phase"] == name and e["step"] == step
        ]
        return sum(e["bytes"] for e in found), max(e["seconds"] for e in found)

    mb = 1024 * 1024
    sync_block = max(r["sync_block_s"] for r in results)
    steady = [r["saves"][1] for r in results]
    block = max(s["save_s"] + s["wait_staged_s"] for s in steady)
    first = max(r["saves"][0]["save_s"] + r["saves"][0]["wait_staged_s"] for r in results)
    no_overlap = max(r["saves"][2]["no_overlap_block_s"] for r in results)
    wbytes, wsec = phase("written", 3)
    wbytes_busy, wsec_busy = phase("written", 2)
    raw_bytes = sum(r["raw_write"]["bytes"] for r in results)
    raw_sec = max(r["raw_write"]["seconds"] for r in results)
    ubytes, usec = phase("uploaded", 2)
    best_threads = max(raw_rates, key=lambda t: raw_rates[t])
    write_rate, raw_rate = wbytes / wsec, raw_bytes / raw_sec
    up_rate = ubytes / usec
    uf_rate = upload_file["bytes"] / upload_file["seconds"]
    print(f"model: {results[0]['params'] / 1e6:.0f}M params + AdamW, {RANKS} ranks (gloo, CPU)")
    print(f"checkpoint bytes per step: {wbytes / mb:.0f} MiB")
    print()
    print(f"{'metric':<52}{'ours':>12}{'baseline':>12}{'ratio':>8}{'target':>9}")
    rows = [
        ("blocking s: async save vs sync dcp.save", block, sync_block, "<= 0.05"),
        ("  (first save, buffers allocated)", first, sync_block, ""),
        ("  (no training step to overlap staging)", no_overlap, sync_block, ""),
        ("write MiB/s: writer phase vs raw sequential", write_rate / mb, raw_rate / mb, ">= 0.8"),
        (
            "  (while the optimizer step runs on the same cores)",
            wbytes_busy / wsec_busy / mb,
            raw_rate / mb,
            "",
        ),
        ("upload MiB/s: writer vs upload_file one by one", up_rate / mb, uf_rate / mb, ">= 2"),
        (
            f"upload MiB/s: writer vs raw parallel PUT ({best_threads} thr)",
            up_rate / mb,
            raw_rates[best_threads] / mb,
            ">= 0.8",
        ),
    ]
    for mode in ("pinned", "thread", "off"):
        ours = max(r["modes"][mode] for r in results)
        # off blocks until the commit, like dcp.save (with 2 write threads).
        target = "<= 0.05" if mode != "off" else ""
        rows.append((f"blocking s: asyncMode={mode} vs sync dcp.save", ours, sync_block, target))
    for name, ours, base, target in rows:
        print(f"{name:<52}{ours:>12.3f}{base:>12.3f}{ours / base:>8.3f}{target:>9}")
    print()
    print("raw parallel PUT MiB/s by threads:", {t: round(r / mb, 1) for t, r in raw_rates.items()})
    print(
        "write phase split:",
        [e["msg"] for r in results for e in r["events"] if e["phase"] == "written"],
    )
    print(
        "writer phases of step 2 (max over ranks, s):",
        {p: round(phase(p, 2)[1], 2) for p in ("staged", "written", "committed", "uploaded")},
    )


if __name__ == "__main__":
    main()
