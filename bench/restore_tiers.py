"""Restore throughput from each tier of issue #23, side by side in one run.

One process (no torch.distributed: world size 1), a model with AdamW whose
checkpoint is >= 1 GiB (default 6 x Linear(4096, 4096): 101M parameters,
1.13 GiB with the optimizer's two moments), saved once by the project's
writer (`CheckpointManager.save`, uploaded to the devcluster's SeaweedFS).
Then, in rounds, the same step is restored by `CheckpointManager.restore`
(verify every file's size and CRC32C, vet the DCP metadata, DCP load: the
trainer's load path) from each tier:

- own memory:  a copy of the step folder in /dev/shm;
- peer memory: the product's restore from a peer's replica, held by a
               `peer.ReplicaServer` in another process (the replica pushed
               once before the rounds), over TCP loopback: the manifest
               and `.metadata` fetched into /dev/shm (`peer.fetch` of
               `memrestore.HEAD_FILES`, checked against the manifest),
               `.metadata` vetted, then `load.load` reading the data files
               from the peer's connection straight into the parameters
               (`cairn.checkpoint.peerread`); memrestore's and restore's
               steps for one rank without the store exchanges (world size
               1 has no peer, so the bench calls them itself; the manifest
               is unsigned here, so not authenticated);
- local volume: the writer's folder on disk, its pages dropped from the page
               cache first (`posix_fadvise(DONTNEED)`; `fincore` says how
               much stayed cached, recorded);
- S3:          an empty directory on disk, so the restore downloads the step
               through the project's fetch path (ranged GETs, CRC32C).

Every tier is restored twice per round, side by side: with the product's
reader (tensor entries read straight into the parameters,
`cairn.checkpoint.tensorread`, `peerread`) and with DCP's own read of every
entry (`torch.load` into a new tensor, then a copy: the bench turns the
direct read off for that arm, nothing else changes). "Transport only" rows
time moving the bytes into files and checking their CRC32C: the whole
replica by `peer.fetch` into /dev/shm, the S3 copy by the project's
download. Every restore starts from
zeroed parameters and must give back the saved parameters bit for bit.
Prints seconds and MiB/s per tier and arm (median of the rounds), the ratios
to S3 in the same arm (goal: peer memory <= 0.2x the S3 time) and each
tier's direct/DCP ratio, with the load average; records
`bench/results/restore-tiers-<size>-<UTC>.json`.

Usage: PYTHONPATH=api:operator:trainer_image:devcluster python bench/restore_tiers.py
       [--layers 6] [--dim 4096] [--rounds 3] [--arms direct,dcp] [--no-record]
Needs the devcluster up (its S3). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import typing
import uuid
import warnings

import record  # bench/, next to this script
import torch

from cairn.checkpoint import (
    layout,
    load,
    manager,
    memrestore,
    options,
    peer,
    peerread,
    remote,
    s3transport,
    state,
    tensorread,
)
from cairn.devcluster import cluster as cluster_mod

MIB = 1024 * 1024
TIERS = ("own_memory", "peer_memory", "local_volume", "s3")
ARMS = ("direct", "dcp")
"""direct: the product's reader; dcp: every entry read DCP's way (the anchor)."""
PEER_DEADLINE_S = 600.0


def serve_peer(root: pathlib.Path, key_file: pathlib.Path) -> None:
    """The peer process: a ReplicaServer until stdin closes; prints its port."""
    with peer.ReplicaServer(root=root, key=key_file.read_bytes(), host="127.0.0.1") as server:
        print(server.address[1], flush=True)
        sys.stdin.read()


def start_peer(work: pathlib.Path, key: bytes) -> tuple[subprocess.Popen[str], tuple[str, int]]:
    key_file = work / "peer.key"
    key_file.touch(mode=0o600)
    key_file.write_bytes(key)  # not in argv: a process list shows argv
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve-peer", str(work / "peer-root"), str(key_file)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the server prints its port once listening
    if not line.strip().isdigit():
        proc.kill()
        raise SystemExit(f"the peer process did not start (said {line!r})")
    return proc, ("127.0.0.1", int(line))


def drop_cache(folder: pathlib.Path) -> str:
    """Drop the folder's files from the page cache; `fincore`'s verdict after."""
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    big = max(folder.iterdir(), key=lambda p: p.stat().st_size)
    try:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--output", "RES", str(big)],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"fincore unavailable ({exc!r})"
    return f"{out.stdout.strip()} of {big.stat().st_size} bytes of {big.name} cached"


class Model:
    """The model, its optimizer (one step taken: the moments exist) and the
    parameters as saved, to check every restore against."""

    def __init__(self, *, layers: int, dim: int, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(
            *[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)]
        )
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        torch.autograd.backward(self.model(torch.randn(4, dim)).square().mean())
        self.optim.step()
        self.optim.zero_grad()
        self.objects: dict[str, state.Stateful] = {
            "model_optim": state.ModelOptimizerState(self.model, self.optim)
        }
        self.saved = [p.detach().clone() for p in self.model.parameters()]
        self.params = sum(p.numel() for p in self.model.parameters())

    def zero(self) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.zero_()

    def check(self, tier: str) -> None:
        for p, want in zip(self.model.parameters(), self.saved, strict=True):
            if not torch.equal(p.detach(), want):
                raise SystemExit(f"{tier}: the restored parameters differ from the saved ones")


def restore(m: Model, *, directory: pathlib.Path, s3: options.S3Options | None, tier: str) -> float:
    """Seconds of `CheckpointManager.restore` from `directory` (else S3)."""
    opts = options.CheckpointOptions(directory=directory, s3=s3, timeout_seconds=1200)
    m.zero()
    with manager.CheckpointManager(opts) as ckpt:
        t0 = time.monotonic()
        result = ckpt.restore(m.objects)
        seconds = time.monotonic() - t0
    if result is None or result.step != 1:
        raise SystemExit(f"{tier}: restored {result}, not step 1")
    m.check(tier)
    return seconds


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
    """What every tier's restore needs (one run)."""

    m: Model
    work: pathlib.Path
    disk: pathlib.Path
    shm: pathlib.Path
    s3: options.S3Options
    address: tuple[str, int]
    key: bytes

    @property
    def step_name(self) -> str:
        return layout.step_dir(self.disk, 1).name


def own_memory(c: Setup) -> dict[str, typing.Any]:
    own = c.shm / "own"
    shutil.copytree(c.disk / c.step_name, own / c.step_name)
    seconds = restore(c.m, directory=own, s3=None, tier="own memory")
    shutil.rmtree(own)
    return {"own_memory": seconds}


def peer_memory(c: Setup) -> dict[str, typing.Any]:
    """The restore from the peer (module docstring), and the transport alone:
    the whole replica fetched into /dev/shm, CRC32C checked."""
    head = c.shm / "head" / c.step_name
    c.m.zero()
    t0 = time.monotonic()
    got = peer.fetch(
        c.address,
        key=c.key,
        job_uid="bench",
        source_rank=0,
        step=1,
        dest=head,
        deadline_s=PEER_DEADLINE_S,
        names=memrestore.HEAD_FILES,
    )
    manifest = layout.read_manifest(head)
    received = {f.path.name: (f.size, f.crc32c) for f in got}
    heads = [e for e in manifest.files if e.path in memrestore.HEAD_FILES]
    if memrestore.received_problems(heads, received):
        raise SystemExit("peer memory: the head files do not match the manifest")
    meta = load.read_metadata(head, manifest=manifest)
    streams = peerread.PeerFiles(
        address=c.address,
        key=c.key,
        job_uid="bench",
        source_rank=0,
        step=1,
        entries={e.path: e for e in manifest.files if e.path not in received},
        deadline_s=PEER_DEADLINE_S,
    )
    load.load(
        head,
        manifest=manifest,
        meta=meta,
        objects=c.m.objects,
        rank=0,
        world=1,
        node_local=False,
        process_group=None,
        streams=streams,
    )
    seconds = time.monotonic() - t0
    c.m.check("peer memory")
    shutil.rmtree(head.parent)
    fetched = c.shm / "fetched"
    t0 = time.monotonic()
    peer.fetch(
        c.address,
        key=c.key,
        job_uid="bench",
        source_rank=0,
        step=1,
        dest=fetched / c.step_name,
        deadline_s=PEER_DEADLINE_S,
    )
    fetch_s = time.monotonic() - t0
    shutil.rmtree(fetched)
    return {"peer_memory": seconds, "peer_transport": fetch_s}


def local_volume(c: Setup) -> dict[str, typing.Any]:
    cached = drop_cache(c.disk / c.step_name)
    return {
        "local_volume": restore(c.m, directory=c.disk, s3=None, tier="local volume"),
        "page_cache": cached,
    }


def s3_tier(c: Setup) -> dict[str, typing.Any]:
    """The restore from S3, and the transport alone: the project's download
    (`remote.download_files`, ranged GETs) + the CRC32C check of every file."""
    empty = c.work / "from-s3"
    seconds = restore(c.m, directory=empty, s3=c.s3, tier="s3")
    shutil.rmtree(empty)
    manifest = layout.read_manifest(c.disk / c.step_name)
    target = c.work / "s3-transport"
    t0 = time.monotonic()
    remote.download_files(
        s3transport.make_client(c.s3),
        c.s3,
        bucket=c.s3.bucket,
        prefix=remote.data_prefix(remote.step_prefix(c.s3, 1), manifest),
        folder=target,
        names=[entry.path for entry in manifest.files],
    )
    if layout.verify_files(target, manifest.files):
        raise SystemExit("s3 transport: the downloaded files do not match the manifest")
    transport_s = time.monotonic() - t0
    shutil.rmtree(target)
    return {"s3": seconds, "s3_transport": transport_s}


TIER_RUNS: tuple[typing.Callable[[Setup], dict[str, typing.Any]], ...] = (
    own_memory,
    peer_memory,
    local_volume,
    s3_tier,
)


@contextlib.contextmanager
def arm(name: str) -> typing.Iterator[None]:
    """The dcp arm: no entry qualifies for the direct read, so every one is
    read DCP's way (the reader's own fallback); the direct arm: as shipped."""
    if name == "direct":
        yield
        return
    kept = tensorread.record_offset, peerread.direct_target
    tensorread.record_offset = lambda *args, **kwargs: None
    peerread.direct_target = lambda *args, **kwargs: False
    try:
        yield
    finally:
        tensorread.record_offset, peerread.direct_target = kept


def arm_key(tier: str, arm_name: str) -> str:
    return tier if arm_name == "direct" else f"{tier}@{arm_name}"


def one_round(c: Setup, *, index: int, arms: typing.Sequence[str]) -> dict[str, typing.Any]:
    """Every tier once per arm, back to back, starting at a different tier each
    round, and each arm first in every other round (the machine's load drifts,
    and the first S3 restore of a pair measured slower whatever its arm: no
    tier and no arm always goes first)."""
    row: dict[str, typing.Any] = {"order": []}
    paired = list(arms) if index % 2 == 0 else list(reversed(arms))
    for i in range(len(TIER_RUNS)):
        run = TIER_RUNS[(index + i) % len(TIER_RUNS)]
        for arm_name in paired:
            row["order"].append(arm_key(run.__name__, arm_name))
            with arm(arm_name):
                got = run(c)
            row.update({arm_key(k, arm_name): v for k, v in got.items()})
    row["load_average"] = list(os.getloadavg())
    return row


def report(
    rows: list[dict[str, typing.Any]], *, nbytes: int, arms: typing.Sequence[str]
) -> dict[str, typing.Any]:
    """Medians, rates and ratios of the rounds; printed and returned. Pure but for print."""
    figures: dict[str, typing.Any] = {"bytes": nbytes, "rounds": rows, "tiers": {}}
    print(f"\ncheckpoint: {nbytes / MIB:.0f} MiB; median of {len(rows)} rounds")
    for arm_name in arms:
        keys = [arm_key(k, arm_name) for k in (*TIERS, "peer_transport", "s3_transport")]
        med = {k: statistics.median(r[k] for r in rows) for k in keys}
        print(
            f"[{arm_name}] {'restore (read + CRC32C + DCP load)':<34}{'seconds':>9}{'MiB/s':>9}{'x S3':>8}"
        )
        for k in keys:
            anchor = arm_key("s3_transport" if "_transport" in k else "s3", arm_name)
            ratio = med[k] / med[anchor]
            rate = nbytes / MIB / med[k]
            figures["tiers"][k] = {"seconds": med[k], "mib_per_s": rate, "ratio_to_s3": ratio}
            if k.startswith("peer_transport"):
                print(f"{'transport only (+ CRC32C check)':<36}")
            print(f"  {k:<34}{med[k]:>9.2f}{rate:>9.0f}{ratio:>8.3f}")
    if "dcp" in arms and "direct" in arms:
        figures["direct_over_dcp"] = {
            tier: figures["tiers"][tier]["seconds"]
            / figures["tiers"][arm_key(tier, "dcp")]["seconds"]
            for tier in TIERS
        }
        print(
            "direct read / DCP's read, same tier: "
            + ", ".join(f"{t} {r:.2f}" for t, r in figures["direct_over_dcp"].items())
        )
    shipped = "direct" if "direct" in arms else arms[0]  # the goal is the product's
    goal = figures["tiers"][arm_key("peer_memory", shipped)]["ratio_to_s3"]
    figures["goal_peer_le_0.2x_s3"] = goal <= 0.2
    print(
        f"goal peer memory <= 0.2x S3 time ({shipped}): {goal:.3f} -> {'met' if goal <= 0.2 else 'NOT met'}"
    )
    cached = [r[k] for r in rows for k in r if k.startswith("page_cache")]
    print(f"page cache before each local restore: {cached}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", default=",".join(ARMS), help="direct, dcp or both")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--serve-peer", nargs=2, type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    if not arms or any(a not in ARMS for a in arms):
        parser.error(f"--arms: a comma-separated subset of {ARMS}")
    if args.serve_peer:
        serve_peer(*args.serve_peer)
        return
    env = record.environment()
    torch.set_num_threads(2)
    warnings.filterwarnings("ignore", "torch.distributed is disabled")  # world size 1
    cluster = cluster_mod.Cluster.default()
    client = cluster.s3_client()
    bucket = f"cairn-bench-restore-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    creds = cluster.s3_credentials()
    s3 = options.S3Options(
        uri=f"s3://{bucket}/bench",
        endpoint_url=cluster.s3_endpoint,
        region="us-east-1",
        access_key=creds.access_key,
        secret_key=creds.secret_key,
    )
    work = pathlib.Path(tempfile.mkdtemp(prefix="cairn-restore-tiers-"))
    shm = pathlib.Path(tempfile.mkdtemp(prefix="cairn-restore-tiers-", dir="/dev/shm"))
    proc = None
    try:
        m = Model(layers=args.layers, dim=args.dim, seed=args.seed)
        disk = work / "volume"
        with manager.CheckpointManager(
            options.CheckpointOptions(directory=disk, s3=s3, timeout_seconds=1200)
        ) as ckpt:
            ckpt.save(1, m.objects, force=True)
            ckpt.wait_until_finished()
        folder = layout.step_dir(disk, 1)
        if not layout.is_uploaded(folder):
            raise SystemExit("the step was not uploaded to S3")
        files = sorted(p for p in folder.iterdir() if p.name != layout.UPLOADED_MARKER)
        nbytes = sum(p.stat().st_size for p in files)
        key = peer.derive_key(os.urandom(32))
        proc, address = start_peer(shm, key)
        t0 = time.monotonic()
        peer.push(
            address,
            key=key,
            job_uid="bench",
            source_rank=0,
            step=1,
            files=files,
            deadline_s=PEER_DEADLINE_S,
        )
        push_s = time.monotonic() - t0
        print(
            f"replica pushed to the peer process: {push_s:.2f}s, {nbytes / MIB / push_s:.0f} MiB/s"
        )
        rows = []
        setup = Setup(m=m, work=work, disk=disk, shm=shm, s3=s3, address=address, key=key)
        for i in range(args.rounds):
            rows.append(one_round(setup, index=i, arms=arms))
            print(
                f"round {i + 1}: "
                + ", ".join(
                    f"{arm_key(t, a)} {rows[-1][arm_key(t, a)]:.2f}s" for t in TIERS for a in arms
                )
            )
        figures = report(rows, nbytes=nbytes, arms=arms)
        figures["peer_push_seconds"] = push_s
        figures["peer_push_mib_per_s"] = nbytes / MIB / push_s
        print(f"load average now: {os.getloadavg()}")
        if not args.no_record:
            params = {**vars(args), "model_params": m.params, "torch_threads": 2}
            params.pop("serve_peer")
            params.pop("no_record")
            path = record.write(
                bench="restore-tiers",
                tag=f"{nbytes / 1024**3:.2f}GiB",
                env=env,
                params=params,
                figures=figures,
            )
            print(f"record: {path}")
    finally:
        if proc is not None:
            proc.communicate(input="", timeout=60)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        paginator = client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket):
            for obj in page.get("Contents", []):
                client.delete_object(Bucket=bucket, Key=obj["Key"])
        client.delete_bucket(Bucket=bucket)


if __name__ == "__main__":
    main()
