"""The in-memory tier, save side: each rank's newest committed files in pod memory,
and a replica of them in its successor's memory: rank (r+S) mod N, S the ranks
per pod (`successor`), so the replica is in another pod.

    start      (collective, at manager start) every rank starts its
               `peer.ReplicaServer` on its own folder of the pod's memory
               (`<memory>/rank-<r>/`: a pod running several ranks holds one
               folder per rank) and publishes its address; all addresses are
               gathered (bounded wait)
    committed  after a step committed locally (writer thread), the step is
               handed to this tier's own worker thread: a save never waits
               for memory or the network
    keep_own   `<memdir>/own/step-<N>/`: this rank's share of the step
               (`share_entries`: its own data files, `.metadata`, and
               `manifest.json`) copied into `.step-<N>.tmp`, an `index.json`
               of sizes and CRC32C taken from the manifest, renamed into
               place; older steps dropped only after the new one is complete
    push       replicas 1: the same files to the successor's replica server
               (`peer.push`, HMAC on `peer.derive_key(manifest key)`)

Errors are logged and reported as a `memory_failed` event, never raised:
the volume and S3 tiers hold the step anyway. The restore side is
`cairn.checkpoint.memrestore`; the picture is docs/checkpointing.md,
"Memory tier".
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import pathlib
import shutil
import socket
import threading
import time
import typing

from cairn.api import manifest as manifest_mod
from cairn.api import podenv
from cairn.checkpoint import coordinator as coordinator_mod
from cairn.checkpoint import events, layout, load, options, peer

log = logging.getLogger(__name__)

OWN_DIR = "own"
INDEX = "index.json"
PUSH_DEADLINE_SECONDS = 120.0
"""Bound on one push of a rank's share to its successor."""
CLOSE_BARRIER_SECONDS = 5.0
"""At close, the longest wait for the other ranks' last pushes."""


def rank_dir(memory: pathlib.Path, rank: int) -> pathlib.Path:
    """Rank `rank`'s folder of the pod's memory volume: ranks of one pod
    (procsPerNode > 1) share the volume, never a folder."""
    return memory / f"rank-{rank}"


def ranks_per_pod(world: int, environ: typing.Mapping[str, str] | None = None) -> int:
    """The stride between a rank and its successor: torchrun's LOCAL_WORLD_SIZE
    (ranks of one pod are consecutive: node_rank x procs + local_rank), so that
    a replica lands in the next pod; 1 when unset, when every rank is in one
    pod, or when it does not divide the world (no pod structure to rely on)."""
    env = os.environ if environ is None else environ
    try:
        local = int(env.get("LOCAL_WORLD_SIZE") or 1)
    except ValueError:
        return 1
    return local if 1 < local < world and world % local == 0 else 1


def successor(rank: int, world: int, stride: int) -> int:
    """The rank holding `rank`'s replica."""
    return (rank + stride) % world


def predecessor(rank: int, world: int, stride: int) -> int:
    """The rank whose replica `rank` holds."""
    return (rank - stride) % world


def own_root(memdir: pathlib.Path) -> pathlib.Path:
    return memdir / OWN_DIR


def own_folder(memdir: pathlib.Path, step: int) -> pathlib.Path:
    return own_root(memdir) / manifest_mod.step_dir_name(step)


def own_steps(memdir: pathlib.Path) -> list[int]:
    """Steps of complete own copies (renamed into place), oldest first."""
    return sorted(layout.step_dirs(own_root(memdir)))


def share_entries(manifest: manifest_mod.Manifest, rank: int) -> tuple[manifest_mod.FileEntry, ...]:
    """The manifest entries a rank keeps in memory: the files it wrote, and
    `.metadata` (its same-world load reads nothing else). Pure."""
    return tuple(e for e in manifest.files if e.rank == rank or e.path == load.METADATA)


def write_index(folder: pathlib.Path, *, manifest: manifest_mod.Manifest, rank: int) -> None:
    """The own copy's index: the step, the rank and its share's manifest entries."""
    entries = share_entries(manifest, rank)
    index = {
        "step": manifest.step,
        "rank": rank,
        "files": [e.model_dump(mode="json") for e in entries],
    }
    (folder / INDEX).write_text(json.dumps(index))


def keep_own(
    *, memdir: pathlib.Path, folder: pathlib.Path, manifest: manifest_mod.Manifest, rank: int
) -> pathlib.Path:
    """Copy this rank's share of the committed `folder` into memory, atomically;
    returns the new own folder. Older own steps are dropped afterwards."""
    root = own_root(memdir)
    root.mkdir(parents=True, exist_ok=True)
    final = own_folder(memdir, manifest.step)
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        entries = share_entries(manifest, rank)
        for entry in entries:
            shutil.copyfile(layout.safe_target(folder, entry.path), tmp / entry.path)
        shutil.copyfile(folder / manifest_mod.MANIFEST_NAME, tmp / manifest_mod.MANIFEST_NAME)
        write_index(tmp, manifest=manifest, rank=rank)
        if final.exists():
            shutil.rmtree(final)  # the same step committed again (a restart): replaced
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for step in own_steps(memdir):
        if step != manifest.step:
            shutil.rmtree(own_folder(memdir, step), ignore_errors=True)
    return final


def peer_key(opts: options.CheckpointOptions) -> bytes | None:
    """The replica protocol's key: derived from the manifest key the pod mounts
    (None without a keyring: no replicas, nothing unauthenticated)."""
    ring = opts.manifest_keyring
    if ring is None or opts.job_uid is None:
        return None
    return peer.derive_key(ring.keys[ring.current])


def advertised_host(environ: typing.Mapping[str, str] | None = None) -> str:
    """The address peers reach this pod at: the local address of the route to
    the job's master (rank 0's pod, which every rank reaches already; a UDP
    connect sends nothing), else the host name's address."""
    env = os.environ if environ is None else environ
    master = env.get("MASTER_ADDR") or env.get(podenv.MASTER_ADDR_CAIRN)
    if master:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                probe.connect((master, 9))
                return str(probe.getsockname()[0])
        except OSError:
            pass  # unresolvable here: fall back to the host name
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class MemoryTier:
    """One rank's memory tier: its replica server and its keeper thread."""

    def __init__(
        self,
        *,
        opts: options.CheckpointOptions,
        coordinator: coordinator_mod.Coordinator,
        callbacks: typing.Sequence[events.ProgressCallback],
    ) -> None:
        assert opts.memory_dir is not None
        self.rank = coordinator.rank
        self.world = coordinator.world_size
        self.memdir: pathlib.Path = rank_dir(opts.memory_dir, self.rank)
        self.stride = ranks_per_pod(self.world)
        self.job_uid = opts.job_uid
        self.key = peer_key(opts) if opts.memory_replicas else None
        self._opts = opts
        self._coord = coordinator
        self._callbacks = tuple(callbacks)
        self._server: peer.ReplicaServer | None = None
        self.addresses: list[tuple[str, int] | None] | None = None
        """Every rank's replica server, by rank (None: that rank has none)."""
        self._latest = 0
        self._lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="cairn-memtier"
        )

    def start(self) -> None:
        """Collective: start the replica server, gather every rank's address."""
        remove_stale(self.memdir)
        if self.key is None:
            if self._opts.memory_replicas:
                log.warning("memory tier: no manifest keyring, so no peer replicas")
            return
        mine: dict[str, typing.Any] = {"host": None}
        try:
            server = peer.ReplicaServer(root=self.memdir, key=self.key, job_uid=self.job_uid)
            server.start()
            self._server = server
            mine = {"host": advertised_host(), "port": server.address[1]}
        except OSError as exc:  # no replicas held here; the exchange still happens
            log.warning("memory tier: replica server not started: %r", exc)
        key = f"memtier-g{self._opts.group}/address"
        self._coord.publish(key, mine)
        found = self._coord.gather(key, timeout=self._opts.timeout_seconds)
        self.addresses = [_address(doc) for doc in found]

    def peer_of(self, rank: int) -> tuple[str, int] | None:
        """The replica server holding `rank`'s replica: its `successor`'s."""
        if self.addresses is None or self.world < 2:
            return None
        return self.addresses[successor(rank, self.world, self.stride)]

    def committed(self, *, folder: pathlib.Path, manifest: manifest_mod.Manifest) -> None:
        """A step committed locally: keep it in memory in the background."""
        with self._lock:
            self._latest = max(self._latest, manifest.step)
        self._executor.submit(self._keep, folder, manifest)

    def _keep(self, folder: pathlib.Path, manifest: manifest_mod.Manifest) -> None:
        if manifest.step < self._latest:
            return  # a newer step is queued: it replaces this one anyway
        t0 = time.monotonic()
        try:
            kept = keep_own(memdir=self.memdir, folder=folder, manifest=manifest, rank=self.rank)
            target = self.peer_of(self.rank)
            if target is not None and self.key is not None and self.job_uid is not None:
                names = [e.path for e in share_entries(manifest, self.rank)]
                peer.push(
                    target,
                    key=self.key,
                    job_uid=self.job_uid,
                    source_rank=self.rank,
                    step=manifest.step,
                    files=[kept / n for n in (*names, manifest_mod.MANIFEST_NAME)],
                    deadline_s=PUSH_DEADLINE_SECONDS,
                )
        except Exception as exc:  # never fatal: the volume and S3 hold the step
            log.warning("memory tier: step %d not kept: %r", manifest.step, exc)
            self._emit("memory_failed", manifest.step, message=repr(exc)[:500])
            return
        nbytes = sum(e.size for e in share_entries(manifest, self.rank))
        self._emit(
            "memory_kept",
            manifest.step,
            seconds=time.monotonic() - t0,
            nbytes=nbytes,
            message="own" + (" + peer" if self.peer_of(self.rank) else ""),
        )

    def _emit(
        self, phase: events.Phase, step: int, *, seconds: float = 0.0, nbytes: int = 0, message: str
    ) -> None:
        event = events.ProgressEvent(
            phase=phase, step=step, rank=self.rank, seconds=seconds, bytes=nbytes, message=message
        )
        events.emit(self._callbacks, event)

    def drain(self) -> None:
        """Wait for the queued keeps (tests, close)."""
        self._executor.submit(lambda: None).result()

    def close(self, *, barrier: bool = True) -> None:
        """Finish the queued keep (older ones skip), then stop serving replicas,
        with `barrier` once every rank finished pushing (bounded: a dead rank
        costs `CLOSE_BARRIER_SECONDS`, then the server stops anyway). No
        barrier after SIGTERM: the pod goes (its memory with it), or torchrun
        restarts the group in place because a rank died, and waiting for
        that rank would only delay the restart."""
        self._executor.shutdown(wait=True)
        if self._server is None:
            return
        if barrier:
            key = f"memtier-g{self._opts.group}/closing"
            wait = min(CLOSE_BARRIER_SECONDS, self._opts.timeout_seconds)
            try:
                self._coord.publish(key, {"ok": True})
                self._coord.gather(key, timeout=wait)
            except Exception as exc:  # a rank is gone: its replica is not pushed anyway
                log.warning("memory tier: not every rank reached close: %r", exc)
        self._server.close()
        self._server = None


def _address(doc: typing.Mapping[str, typing.Any]) -> tuple[str, int] | None:
    """A rank's published server address; anything malformed is no server."""
    host, port = doc.get("host"), doc.get("port")
    if not isinstance(host, str) or not isinstance(port, int) or not 0 < port < 65536:
        return None
    return host, port


def start(
    opts: options.CheckpointOptions,
    *,
    coordinator: coordinator_mod.Coordinator,
    callbacks: typing.Sequence[events.ProgressCallback],
) -> MemoryTier | None:
    """The started tier when `opts.memory_dir` is set (collective), else None."""
    if opts.memory_dir is None:
        return None
    tier = MemoryTier(opts=opts, coordinator=coordinator, callbacks=callbacks)
    tier.start()
    return tier


def remove_stale(memdir: pathlib.Path) -> None:
    """Leftovers of a keeper that died mid-copy (`.step-<N>.tmp`): ours, removed."""
    root = own_root(memdir)
    if root.is_dir():
        for child in root.iterdir():
            if child.name.startswith(".step-") and child.name.endswith(".tmp"):
                shutil.rmtree(child, ignore_errors=True)
    os.makedirs(memdir, exist_ok=True)
