"""The anchors `bench/checkpoint.py` measures in its rank processes, side by side.

Each function runs on every rank at once (barriers around the timed part)
and returns this rank's seconds; the report takes the max over ranks.

- `raw_writes`: the same bytes written raw into a new folder, one stream
  per rank, and with the writer's thread count (one file per thread, as
  many as the writer's data files), each file fsynced, then the folder: the
  write phase's anchors;
- `write_phase_old_new`: the write phase as it was (DCP write with DCP's
  fsync, then a read-back CRC32C pass) against the one-pass writer
  (`cairn.checkpoint.writer`), alternating, on the same state;
- `async_save_rows`: `dcp.async_save` with DCP's own pinned/async stager,
  the stall anchor that does the same job as ours;
- `signing_rows`: the writer's write + commit phases with and without
  manifest signing (`CheckpointOptions.manifest_keyring`);
- `upload_baselines` (bench process, after the ranks): boto3 `upload_file`
  file by file and raw parallel PUTs at 8/16/32 threads.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import pathlib
import resource
import shutil
import threading
import time
import typing

import boto3
import botocore.config
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import filesystem, staging, state_dict_saver

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import events, layout, load, manager, options, pipeline, state, writer

_BUFFER = bytearray(os.urandom(1024 * 1024) * 64)


def _raw_file(path: pathlib.Path, nbytes: int) -> None:
    with path.open("wb") as stream:
        left = nbytes
        while left > 0:
            chunk = memoryview(_BUFFER)[: min(left, len(_BUFFER))]
            stream.write(chunk)
            left -= len(chunk)
        stream.flush()
        os.fsync(stream.fileno())


def raw_writes(work: pathlib.Path, *, rank: int, nbytes: int, threads: int) -> dict[str, float]:
    """Seconds to write `nbytes` raw + fsync: one stream, then `threads` files at once.

    The same durable work as the writer's write phase: a new folder, the
    files in it (as many as the writer's data files per rank), each fsynced,
    then the folder fsynced (its entries durable)."""
    result: dict[str, float] = {}
    single = work / f"raw-{rank}-single"
    dist.barrier()
    t0 = time.monotonic()
    single.mkdir()
    _raw_file(single / "0.bin", nbytes)
    layout.fsync_dir(single)
    result["single_s"] = time.monotonic() - t0
    dist.barrier()
    shutil.rmtree(single)
    parallel = work / f"raw-{rank}-parallel"
    parts = [nbytes // threads + (1 if i < nbytes % threads else 0) for i in range(threads)]
    workers = [
        threading.Thread(target=_raw_file, args=(parallel / f"{i}.bin", part))
        for i, part in enumerate(parts)
    ]
    dist.barrier()
    t0 = time.monotonic()
    parallel.mkdir()
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    layout.fsync_dir(parallel)
    result["parallel_s"] = time.monotonic() - t0
    dist.barrier()
    shutil.rmtree(parallel)
    return result


def _old_write_phase(
    folder: pathlib.Path,
    snapshot: dict[str, typing.Any],
    *,
    rank: int,
    threads: int,
    group: typing.Any,
) -> None:
    """The write phase before the one-pass writer: DCP fsyncs, then a read-back CRC32C."""
    state_dict_saver.save(
        snapshot,
        storage_writer=filesystem.FileSystemWriter(folder, sync_files=True, thread_count=threads),
        planner=load.save_planner(),
        process_group=group,
    )
    for name in pipeline.own_files(folder, rank):
        layout.entry_for(folder, name, rank=rank)
    layout.fsync_dir(folder)


def _new_write_phase(
    folder: pathlib.Path,
    snapshot: dict[str, typing.Any],
    *,
    rank: int,
    threads: int,
    group: typing.Any,
) -> None:
    """The write phase as `pipeline.run_step` runs it now."""
    dcp_writer = writer.ChecksummingWriter(folder, thread_count=threads)
    state_dict_saver.save(
        snapshot, storage_writer=dcp_writer, planner=load.save_planner(), process_group=group
    )
    writer.entries(
        folder,
        pipeline.own_files(folder, rank),
        rank=rank,
        written=dcp_writer.checksum_fs.checksums(),
    )
    layout.fsync_dir(folder)


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def write_phase_old_new(
    work: pathlib.Path,
    snapshot: dict[str, typing.Any],
    *,
    rank: int,
    threads: int,
    group: typing.Any,
    rounds: int,
) -> dict[str, list[float]]:
    """Wall seconds (`old`, `new`) and this process's CPU seconds (`old_cpu`,
    `new_cpu`: what the machine's load moves least) of each write phase kind,
    alternating old/new `rounds` times, in ABBA order."""
    kinds = {"old": _old_write_phase, "new": _new_write_phase}
    result: dict[str, list[float]] = {k: [] for kind in kinds for k in (kind, f"{kind}_cpu")}
    for n in range(rounds):
        # ABBA: neither kind always runs second (after the other's writes).
        for kind, phase in list(kinds.items())[:: 1 if n % 2 == 0 else -1]:
            folder = work / f"phase-{kind}-{n}"
            dist.barrier()
            t0, cpu0 = time.monotonic(), _cpu_seconds()
            phase(folder, snapshot, rank=rank, threads=threads, group=group)
            result[kind].append(time.monotonic() - t0)
            result[f"{kind}_cpu"].append(_cpu_seconds() - cpu0)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
    return result


def async_save_rows(
    work: pathlib.Path,
    objects: dict[str, state.Stateful],
    *,
    forward_backward: typing.Callable[[], None],
    optim: torch.optim.Optimizer,
    group: typing.Any,
    threads: int,
) -> list[dict[str, float]]:
    """`dcp.async_save` with DCP's pinned/async stager, two saves (the first
    allocates): blocking = the call + the wait for staging after a training
    step, as for ours; done = until the files are written."""
    stager = staging.DefaultStager(
        staging.StagingOptions(
            use_pinned_memory=True,
            use_shared_memory=True,
            use_async_staging=True,
            use_non_blocking_copy=False,  # raises without an accelerator
        )
    )
    saves: list[dict[str, float]] = []
    try:
        for n in range(2):
            dist.barrier()
            t0 = time.monotonic()
            snapshot = {"model_optim": objects["model_optim"].state_dict()}
            response = state_dict_saver.async_save(
                snapshot,
                storage_writer=filesystem.FileSystemWriter(
                    work / f"async-save-{n}", sync_files=True, thread_count=threads
                ),
                process_group=group,
                async_stager=stager,
            )
            call_s = time.monotonic() - t0
            assert isinstance(response, state_dict_saver.AsyncSaveResponse)
            forward_backward()
            t1 = time.monotonic()
            response.staging_completion.result()
            block_s = call_s + time.monotonic() - t1
            optim.step()
            optim.zero_grad()
            response.upload_completion.result()
            saves.append({"block_s": block_s, "done_s": time.monotonic() - t0})
            del snapshot
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(work / f"async-save-{n}", ignore_errors=True)
    finally:
        stager.close()
    return saves


def signing_rows(
    opts: options.CheckpointOptions,
    objects: dict[str, state.Stateful],
    work: pathlib.Path,
    *,
    rounds: int = 2,
) -> dict[str, list[float]]:
    """Write + commit seconds of the writer unsigned and signed (no S3), `rounds`
    saves each, alternating; and the seconds of one `manifest.sign` call on the
    step's real manifest (the whole difference signing makes to the step)."""
    keyring = manifest_mod.Keyring(current="bench", keys={"bench": os.urandom(32)})
    kinds = {"unsigned": None, "signed": keyring}
    result: dict[str, list[float]] = {kind: [] for kind in kinds}
    for n in range(rounds):
        # ABBA: neither kind always runs second.
        for kind, ring in list(kinds.items())[:: 1 if n % 2 == 0 else -1]:
            seen: list[events.ProgressEvent] = []
            kind_opts = dataclasses.replace(
                opts,
                directory=work / f"sign-{kind}-{n}",
                s3=None,
                job_uid="bench-job",
                manifest_keyring=ring,
            )
            with manager.CheckpointManager(kind_opts, callbacks=[seen.append]) as ckpt:
                dist.barrier()
                ckpt.save(1, objects, force=True)
                ckpt.wait_until_finished()
            result[kind].append(sum(e.seconds for e in seen if e.phase in ("written", "committed")))
            if ring is not None:  # the signature alone, on this step's real manifest
                manifest = layout.read_manifest(layout.step_dir(kind_opts.directory, 1))
                t0 = time.monotonic()
                for _ in range(100):
                    manifest_mod.sign(manifest, ring)
                result.setdefault("sign_call", []).append((time.monotonic() - t0) / 100)
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(work / f"sign-{kind}-{n}", ignore_errors=True)
    return result


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
