"""Peer replicas of a rank's newest committed shard: the server each rank runs and
the two client calls (`push`, `fetch`). The memory tier (`memtier`) calls these.

Wire (`cairn.checkpoint.peerwire`): length-prefixed JSON headers and raw file
bytes over TCP, never pickle; a mutual HMAC challenge-response on the job's
peer key (`derive_key`) binding the job UID comes first, so a party without
the key is refused before any data moves. Then one request per connection:

    push   C: {"op": "push", "source_rank": r, "step": N,
               "files": [{"name", "size"}, ...]}
           S: {"ok": true} (or refused: bad name, over the size caps, a newer
              step already held) -> C: each file's bytes, in order
           C: {"op": "done", "crc32c": [8 hex digits per file]}
           S: checks every CRC32C it counted, renames the replica into place
              (newest step per source rank wins), {"ok": true}
    fetch  C: {"op": "fetch", "source_rank": r, "step": N[, "names": [...]]}
           S: {"ok": true, "files": [{"name", "size", "crc32c"}, ...]}, the
              bytes (only the named files, in that order, when `names` is
              given; a name the replica lacks is refused); C checks each
              file's size and CRC32C as it arrives and renames the files
              into `dest` only when all of them match. `open_file` is the
              same request for one file whose bytes the caller reads itself
              (`cairn.checkpoint.peerread`: straight into the tensors).

The server stores `root/peer/rank-<r>/step-<N>/` (the files and
`.cairn-replica.json`: job UID, step, each file's size and CRC32C), writes
into a `.tmp-...` folder first and keeps only the newest step per source
rank. Names are plain base names (never a path out of the folder); sizes
and counts are capped. Every socket operation has a timeout and every
transfer a deadline, on both ends: a peer that stops sending costs at most
that, then `PeerUnavailable`. Files are streamed in `peerwire.CHUNK`s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac
import json
import os
import pathlib
import re
import secrets
import shutil
import socket
import socketserver
import threading
import typing

from awscrt import checksums

from cairn.checkpoint import peerwire
from cairn.checkpoint.peerwire import PeerUnavailable

__all__ = [
    "FetchedFile",
    "Incoming",
    "PeerUnavailable",
    "ReplicaServer",
    "derive_key",
    "fetch",
    "open_file",
    "push",
]

MAX_FILE_BYTES = 256 * 1024**3
MAX_FILES = 4096
_STEP_DIR = re.compile(r"step-(\d{1,18})")
_MAX_RANK = 2**31 - 1
_MAX_STEP = 10**18 - 1


def derive_key(manifest_key: bytes) -> bytes:
    """The peer protocol's key from the job's manifest key: HMAC-SHA256 under
    its own label, so a peer proof can never be used as a manifest signature
    (which MACs canonical JSON) or the other way round. Pure."""
    return hmac.new(manifest_key, b"cairn-peer-replica-key-v1", hashlib.sha256).digest()


# -- client ------------------------------------------------------------------


def _connect(
    address: tuple[str, int], *, key: bytes, job_uid: str, deadline_s: float, io_timeout_s: float
) -> peerwire.Channel:
    peer = f"peer {address[0]}:{address[1]}"
    deadline = peerwire.Deadline(deadline_s, what=peer)
    try:
        sock = socket.create_connection(address, timeout=deadline.timeout(io_timeout_s))
    except OSError as exc:
        raise PeerUnavailable(f"{peer}: connect failed: {exc!r}") from exc
    chan = peerwire.Channel(sock, deadline=deadline, io_timeout=io_timeout_s, peer=peer)
    try:
        peerwire.client_handshake(chan, key=key, job_uid=job_uid)
    except BaseException:
        sock.close()
        raise
    return chan


def push(
    address: tuple[str, int],
    *,
    key: bytes,
    job_uid: str,
    source_rank: int,
    step: int,
    files: typing.Sequence[pathlib.Path],
    deadline_s: float,
    io_timeout_s: float = 10.0,
) -> None:
    """Send `files` (plain names kept) as `source_rank`'s replica of `step`;
    returns once the server has checked every CRC32C and renamed it into place.
    ValueError: the caller's files cannot be a replica (a name the protocol
    refuses, a name twice); PeerUnavailable: anything else."""
    try:
        names = [peerwire.check_name(path.name) for path in files]
    except PeerUnavailable as exc:
        raise ValueError(str(exc)) from exc
    if len(set(names)) != len(names):
        raise ValueError(f"file names repeat: {names}")
    try:
        sizes = [path.stat().st_size for path in files]
    except OSError as exc:
        raise PeerUnavailable(f"cannot read a file to push: {exc!r}") from exc
    chan = _connect(
        address, key=key, job_uid=job_uid, deadline_s=deadline_s, io_timeout_s=io_timeout_s
    )
    with chan.sock:
        chan.send_msg(
            {
                "op": "push",
                "source_rank": source_rank,
                "step": step,
                "files": [{"name": n, "size": s} for n, s in zip(names, sizes, strict=True)],
            }
        )
        chan.expect_ok("push")
        crcs = [_send_file(chan, path, size) for path, size in zip(files, sizes, strict=True)]
        chan.send_msg({"op": "done", "crc32c": crcs})
        chan.expect_ok("push commit")


def _send_file(chan: peerwire.Channel, path: pathlib.Path, size: int) -> str:
    """Stream exactly `size` bytes of `path`; returns their CRC32C."""
    buf = bytearray(min(peerwire.CHUNK, max(size, 1)))
    view = memoryview(buf)
    crc = 0
    left = size
    try:
        with path.open("rb", buffering=0) as stream:
            while left:
                n = stream.readinto(view[: min(left, len(buf))])
                if not n:
                    raise PeerUnavailable(f"{path.name} shrank while being pushed")
                crc = checksums.crc32c(view[:n], crc)
                chan.send(view[:n])
                left -= n
    except OSError as exc:
        raise PeerUnavailable(f"cannot read {path.name}: {exc!r}") from exc
    return f"{crc:08x}"


@dataclasses.dataclass(frozen=True, slots=True)
class FetchedFile:
    """A fetched file, with the size and CRC32C the client counted as its
    bytes arrived (equal to the replica record's, or the fetch failed)."""

    path: pathlib.Path
    size: int
    crc32c: str


def fetch(
    address: tuple[str, int],
    *,
    key: bytes,
    job_uid: str,
    source_rank: int,
    step: int,
    dest: pathlib.Path,
    deadline_s: float,
    io_timeout_s: float = 10.0,
    max_file_bytes: int = MAX_FILE_BYTES,
    names: typing.Sequence[str] | None = None,
) -> list[FetchedFile]:
    """`source_rank`'s replica of `step` from the peer, into `dest` (created);
    every file's size and CRC32C checked before any is renamed into place.
    `names`: only these files (else all). Returns the files in the server's
    order, each with the CRC32C counted on arrival (a caller can compare it
    with a manifest instead of reading the files again)."""
    chan = _connect(
        address, key=key, job_uid=job_uid, deadline_s=deadline_s, io_timeout_s=io_timeout_s
    )
    parts: list[tuple[pathlib.Path, pathlib.Path]] = []
    counted: list[tuple[int, str]] = []
    with chan.sock:
        listed = _request(
            chan, source_rank=source_rank, step=step, names=names, max_file_bytes=max_file_bytes
        )
        try:
            dest.mkdir(parents=True, exist_ok=True)
            for name, size, crc in listed:
                part = dest / f".{name}.peer-part-{secrets.token_hex(4)}"
                parts.append((part, dest / name))
                got = _receive_file(chan, part, size)
                if got != crc:
                    raise PeerUnavailable(
                        f"{chan.peer}: {name} crc32c {got} != replica record {crc}"
                    )
                counted.append((size, got))
            for part, final in parts:
                os.replace(part, final)
        except OSError as exc:
            raise PeerUnavailable(f"cannot write the fetched replica: {exc!r}") from exc
        finally:
            for part, _ in parts:
                part.unlink(missing_ok=True)
    return [
        FetchedFile(path=final, size=size, crc32c=crc)
        for (_, final), (size, crc) in zip(parts, counted, strict=True)
    ]


def _request(
    chan: peerwire.Channel,
    *,
    source_rank: int,
    step: int,
    names: typing.Sequence[str] | None,
    max_file_bytes: int,
) -> list[tuple[str, int, str]]:
    """Send a fetch request; the server's (name, size, crc32c) list, checked
    to be exactly `names` in order when given."""
    request: dict[str, typing.Any] = {"op": "fetch", "source_rank": source_rank, "step": step}
    if names is not None:
        request["names"] = [peerwire.check_name(n) for n in names]
    chan.send_msg(request)
    listed = _file_list(chan.expect_ok("fetch").get("files"), max_file_bytes=max_file_bytes)
    if names is not None and [name for name, _, _ in listed] != list(names):
        raise PeerUnavailable(f"{chan.peer}: sent other files than the {len(names)} asked for")
    return listed


@dataclasses.dataclass(frozen=True, slots=True)
class Incoming:
    """One replica file about to arrive: its bytes follow on `chan`
    (exactly `size` of them; the replica record says `crc32c`)."""

    chan: peerwire.Channel
    name: str
    size: int
    crc32c: str


@contextlib.contextmanager
def open_file(
    address: tuple[str, int],
    *,
    key: bytes,
    job_uid: str,
    source_rank: int,
    step: int,
    name: str,
    deadline_s: float,
    io_timeout_s: float = 10.0,
    max_file_bytes: int = MAX_FILE_BYTES,
) -> typing.Iterator[Incoming]:
    """One file of `source_rank`'s replica of `step`, for the caller to read
    from the connection (`Incoming.chan.recv_into`, bounded like every
    operation here) and check itself: nothing is written anywhere."""
    chan = _connect(
        address, key=key, job_uid=job_uid, deadline_s=deadline_s, io_timeout_s=io_timeout_s
    )
    with chan.sock:
        ((_, size, crc),) = _request(
            chan, source_rank=source_rank, step=step, names=[name], max_file_bytes=max_file_bytes
        )
        yield Incoming(chan=chan, name=name, size=size, crc32c=crc)


def _file_list(value: object, *, max_file_bytes: int) -> list[tuple[str, int, str]]:
    """(name, size, crc32c) of each entry of an untrusted file list. Pure."""
    if not isinstance(value, list) or len(value) > MAX_FILES:
        raise PeerUnavailable("the file list is malformed or too long")
    out: list[tuple[str, int, str]] = []
    for entry in value:
        if not isinstance(entry, dict):
            raise PeerUnavailable("a file entry is not an object")
        out.append(
            (
                peerwire.check_name(entry.get("name")),
                peerwire.check_count(entry.get("size"), what="size", limit=max_file_bytes),
                peerwire.check_crc(entry.get("crc32c")),
            )
        )
    if len({name for name, _, _ in out}) != len(out):
        raise PeerUnavailable("file names repeat")
    return out


def _receive_file(chan: peerwire.Channel, path: pathlib.Path, size: int) -> str:
    """Write exactly `size` bytes from the connection to a new file `path`;
    their CRC32C. (A shared mapping of the file instead of the buffer was
    slower here: a page fault per 4 KiB.)"""
    buf = bytearray(min(peerwire.CHUNK, max(size, 1)))
    view = memoryview(buf)
    crc = 0
    left = size
    with path.open("xb", buffering=0) as stream:
        while left:
            n = min(left, len(buf))
            chan.recv_into(view[:n])
            crc = checksums.crc32c(view[:n], crc)
            if stream.write(view[:n]) != n:
                raise OSError(f"short write to {path.name}")
            left -= n
    return f"{crc:08x}"


# -- server ------------------------------------------------------------------


class ReplicaServer:
    """Holds peers' replicas under `root/peer/`; one thread per connection (at
    most `max_connections`; more are closed at once), every operation bounded
    (`io_timeout_s` each, `handshake_deadline_s` until the client proved the
    key, then `transfer_deadline_s`). `job_uid`: refuse other jobs' hellos
    (None: any job that proves the key; each replica records its job and is
    served to that job only)."""

    def __init__(
        self,
        *,
        root: pathlib.Path,
        key: bytes,
        host: str = "0.0.0.0",
        port: int = 0,
        job_uid: str | None = None,
        max_file_bytes: int = MAX_FILE_BYTES,
        max_total_bytes: int = MAX_FILE_BYTES,
        io_timeout_s: float = 10.0,
        transfer_deadline_s: float = 600.0,
        handshake_deadline_s: float = 10.0,
        max_connections: int = 8,
    ) -> None:
        self.store = pathlib.Path(root) / "peer"
        self.key = key
        self.job_uid = job_uid
        self.max_file_bytes = max_file_bytes
        self.max_total_bytes = max_total_bytes
        self.io_timeout_s = io_timeout_s
        self.transfer_deadline_s = transfer_deadline_s
        self.handshake_deadline_s = handshake_deadline_s
        self._bind = (host, port)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._commit_lock = threading.Lock()
        self._server: socketserver.ThreadingTCPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.store.mkdir(parents=True, exist_ok=True)
        for leftover in self.store.glob("rank-*/.tmp-*"):
            shutil.rmtree(leftover, ignore_errors=True)  # our own unfinished pushes
        owner = self

        class _Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                owner._serve(self.request, self.client_address)

        server = socketserver.ThreadingTCPServer(self._bind, _Handler, bind_and_activate=False)
        server.daemon_threads = True
        server.allow_reuse_address = True
        server.server_bind()
        server.server_activate()
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        if self._server is None:
            raise RuntimeError("ReplicaServer.start() first")
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> ReplicaServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self, sock: socket.socket, client: tuple[str, int]) -> None:
        """One connection: handshake, one request. Failures end the connection."""
        if not self._slots.acquire(blocking=False):
            sock.close()
            return
        peer = f"client {client[0]}:{client[1]}"
        # An unauthenticated party holds a slot for the handshake's deadline at most.
        handshake = peerwire.Deadline(self.handshake_deadline_s, what=f"{peer} handshake")
        chan = peerwire.Channel(sock, deadline=handshake, io_timeout=self.io_timeout_s, peer=peer)
        try:
            uid = peerwire.server_handshake(chan, key=self.key, job_uid=self.job_uid)
            chan.deadline = peerwire.Deadline(self.transfer_deadline_s, what=peer)
            request = chan.recv_msg()
            try:
                source = peerwire.check_count(
                    request.get("source_rank"), what="rank", limit=_MAX_RANK
                )
                step = peerwire.check_count(request.get("step"), what="step", limit=_MAX_STEP)
            except PeerUnavailable as exc:
                peerwire.refuse(chan, str(exc))
            if request.get("op") == "push":
                self._receive_push(chan, request, uid=uid, source=source, step=step)
            elif request.get("op") == "fetch":
                try:
                    names = _names(request.get("names"))
                except PeerUnavailable as exc:
                    peerwire.refuse(chan, str(exc))
                self._send_replica(chan, uid=uid, source=source, step=step, names=names)
            else:
                peerwire.refuse(chan, "unknown op")
        except PeerUnavailable:
            pass  # the client sees the refusal or the closed connection
        except OSError as exc:  # this side's storage (full, unwritable): tell the client
            with contextlib.suppress(PeerUnavailable):
                chan.send_msg({"ok": False, "error": f"replica storage failed: {exc.strerror}"})
        finally:
            sock.close()
            self._slots.release()

    def _rank_dir(self, source: int) -> pathlib.Path:
        return self.store / f"rank-{source}"

    def newest_step(self, source: int) -> int | None:
        """The step of `source`'s replica held here, if any."""
        steps = [
            int(m.group(1))
            for p in self._rank_dir(source).glob("step-*")
            if (m := _STEP_DIR.fullmatch(p.name))
        ]
        return max(steps, default=None)

    def _receive_push(
        self,
        chan: peerwire.Channel,
        request: dict[str, typing.Any],
        *,
        uid: str,
        source: int,
        step: int,
    ) -> None:
        try:
            listed = _push_list(request.get("files"), max_file_bytes=self.max_file_bytes)
        except PeerUnavailable as exc:
            peerwire.refuse(chan, str(exc))
        if sum(size for _, size in listed) > self.max_total_bytes:
            peerwire.refuse(chan, f"replica over {self.max_total_bytes} bytes")
        held = self.newest_step(source)
        if held is not None and held > step:
            peerwire.refuse(chan, f"step {step} is older than the held step {held}")
        rank_dir = self._rank_dir(source)
        rank_dir.mkdir(parents=True, exist_ok=True)
        tmp = rank_dir / f".tmp-step-{step}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            chan.send_msg({"ok": True})
            problem = self._receive_into(chan, tmp, listed, uid=uid, source=source, step=step)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already once committed
        if problem:  # the folder is gone before the client hears of it
            peerwire.refuse(chan, problem)
        chan.send_msg({"ok": True})

    def _receive_into(
        self,
        chan: peerwire.Channel,
        tmp: pathlib.Path,
        listed: list[tuple[str, int]],
        *,
        uid: str,
        source: int,
        step: int,
    ) -> str | None:
        """Receive the files into `tmp`, check their CRC32Cs, commit; the
        reason when refused."""
        crcs = [_receive_file(chan, tmp / name, size) for name, size in listed]
        done = chan.recv_msg()
        if done.get("op") != "done" or done.get("crc32c") != crcs:
            return "a file's crc32c does not match what was received"
        record = {
            "job_uid": uid,
            "source_rank": source,
            "step": step,
            "files": [
                {"name": n, "size": s, "crc32c": c} for (n, s), c in zip(listed, crcs, strict=True)
            ],
        }
        (tmp / peerwire.REPLICA_META).write_text(json.dumps(record))
        if not self._commit(tmp, source=source, step=step):
            return f"a newer step than {step} arrived meanwhile"
        return None

    def _commit(self, tmp: pathlib.Path, *, source: int, step: int) -> bool:
        """Rename the replica into place unless a newer step is held; drop older
        ones (and an earlier copy of the same step). False: ours was stale."""
        with self._commit_lock:
            held = self.newest_step(source)
            if held is not None and held > step:
                return False
            final = self._rank_dir(source) / f"step-{step}"
            if final.exists():
                old = final.with_name(f".tmp-old-{step}-{secrets.token_hex(4)}")
                final.rename(old)
                shutil.rmtree(old, ignore_errors=True)
            tmp.rename(final)
            for other in self._rank_dir(source).glob("step-*"):
                if other != final and _STEP_DIR.fullmatch(other.name):
                    shutil.rmtree(other, ignore_errors=True)
            return True

    def _send_replica(
        self,
        chan: peerwire.Channel,
        *,
        uid: str,
        source: int,
        step: int,
        names: list[str] | None,
    ) -> None:
        folder = self._rank_dir(source) / f"step-{step}"
        try:
            record = json.loads((folder / peerwire.REPLICA_META).read_text())
            listed = _file_list(record.get("files"), max_file_bytes=self.max_file_bytes)
            if record.get("job_uid") != uid or record.get("step") != step:
                raise PeerUnavailable("the replica is another job's or another step's")
            if names is not None:
                by_name = {entry[0]: entry for entry in listed}
                missing = [n for n in names if n not in by_name]
                if missing:
                    raise PeerUnavailable(f"the replica has no {missing[0]!r}")
                listed = [by_name[n] for n in names]
            for name, size, _ in listed:
                if (folder / name).stat().st_size != size:
                    raise PeerUnavailable(f"{name} changed size in storage")
        except (OSError, ValueError, AttributeError, PeerUnavailable) as exc:
            peerwire.refuse(chan, f"no usable replica of rank {source} step {step}: {exc}")
        chan.send_msg(
            {"ok": True, "files": [{"name": n, "size": s, "crc32c": c} for n, s, c in listed]}
        )
        for name, size, _ in listed:
            try:
                with (folder / name).open("rb") as stream:
                    chan.sendfile(stream, size)  # the client checks every CRC32C
            except OSError as exc:
                raise PeerUnavailable(f"cannot read the replica's {name}: {exc!r}") from exc


def _names(value: object) -> list[str] | None:
    """The file names a fetch asks for (None: all), checked. Pure."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) > MAX_FILES:
        raise PeerUnavailable("the requested names are malformed or too many")
    names = [peerwire.check_name(n) for n in value]
    if len(set(names)) != len(names):
        raise PeerUnavailable("requested names repeat")
    return names


def _push_list(value: object, *, max_file_bytes: int) -> list[tuple[str, int]]:
    """(name, size) of each entry of an untrusted push header. Pure."""
    if not isinstance(value, list) or len(value) > MAX_FILES:
        raise PeerUnavailable("the file list is malformed or too long")
    out = []
    for entry in value:
        if not isinstance(entry, dict):
            raise PeerUnavailable("a file entry is not an object")
        name = peerwire.check_name(entry.get("name"))
        out.append(
            (name, peerwire.check_count(entry.get("size"), what="size", limit=max_file_bytes))
        )
    if len({name for name, _ in out}) != len(out):
        raise PeerUnavailable("file names repeat")
    return out
