"""The peer replica transport (`cairn.checkpoint.peer`), real TCP sockets on loopback.

Covers:
- push then fetch: bytes identical (a multi-chunk file, an empty one,
  `.metadata`), stored under `root/peer/rank-<r>/step-<N>/`;
- a fetch of named files gets only those, in the order asked; a name the
  replica lacks and a name asked twice are refused; `open_file` hands over
  one file's bytes on the connection with the record's size and CRC32C;
- a client without the key, and a server without the key, are refused
  before any data moves (nothing stored, nothing written to `dest`);
- a client of another job is refused by a server bound to a job, and a
  replica pushed by one job is not served to another;
- file names with `/`, `..` or the replica record's name are refused by the
  server (raw authenticated client) and by the client (a server's list);
- a byte flipped in the stored replica is caught by the CRC32C on fetch,
  and `dest` keeps no partial file; a byte flipped in transit (a loopback
  proxy) is caught on push by the server and on fetch by the client;
- a peer that accepts and never answers, a client that never says hello,
  and a client that stops sending mid-file, each fail in bounded time
  (PeerUnavailable; the server drops the unfinished push);
- bad requests: a rank or step that is not a non-negative integer, and the
  caller's own files that cannot form a replica (ValueError);
- a newer step replaces the older one, an older push is refused, and of
  two concurrent pushes of one source the newer step wins;
- `derive_key` is deterministic and distinct from the manifest key.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import threading
import time
import typing

import pytest

from cairn.checkpoint import layout, peer, peerwire

KEY = peer.derive_key(b"manifest-key-of-job-a")
JOB = "job-a-uid"


@pytest.fixture
def server(tmp_path: pathlib.Path) -> typing.Iterator[peer.ReplicaServer]:
    with peer.ReplicaServer(
        root=tmp_path / "srv", key=KEY, host="127.0.0.1", io_timeout_s=1.0
    ) as srv:
        yield srv


def _files(folder: pathlib.Path, sizes: dict[str, int]) -> list[pathlib.Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, size in sizes.items():
        path = folder / name
        path.write_bytes(os.urandom(size))
        out.append(path)
    return out


def _push(
    srv: peer.ReplicaServer, files: list[pathlib.Path], *, step: int, **kw: typing.Any
) -> None:
    args: dict[str, typing.Any] = {"key": KEY, "job_uid": JOB, "source_rank": 0, "deadline_s": 30}
    peer.push(srv.address, step=step, files=files, **{**args, **kw})


def _fetch(
    srv: peer.ReplicaServer, dest: pathlib.Path, *, step: int, **kw: typing.Any
) -> list[peer.FetchedFile]:
    args: dict[str, typing.Any] = {"key": KEY, "job_uid": JOB, "source_rank": 0, "deadline_s": 30}
    return peer.fetch(srv.address, step=step, dest=dest, **{**args, **kw})


def test_push_then_fetch_round_trip(server: peer.ReplicaServer, tmp_path: pathlib.Path) -> None:
    sizes = {"__0_0.distcp": 2 * peerwire.CHUNK + 12345, ".metadata": 777, "empty": 0}
    files = _files(tmp_path / "src", sizes)
    _push(server, files, step=7, source_rank=3)
    stored = server.store / "rank-3" / "step-7"
    assert sorted(p.name for p in stored.iterdir()) == sorted([*sizes, peerwire.REPLICA_META])
    got = _fetch(server, tmp_path / "dest", step=7, source_rank=3)
    assert [f.path.name for f in got] == list(sizes)
    for f in got:  # what the client counted on arrival
        assert (f.size, f.crc32c) == layout.file_crc32c(f.path)
    for path in files:
        assert (tmp_path / "dest" / path.name).read_bytes() == path.read_bytes()
    assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == sorted(sizes)


def test_fetch_of_named_files_and_open_file(
    server: peer.ReplicaServer, tmp_path: pathlib.Path
) -> None:
    sizes = {"__0_0.distcp": peerwire.CHUNK + 5, ".metadata": 77, "manifest.json": 9}
    files = _files(tmp_path / "src", sizes)
    _push(server, files, step=2)
    got = _fetch(server, tmp_path / "dest", step=2, names=["manifest.json", ".metadata"])
    assert [f.path.name for f in got] == ["manifest.json", ".metadata"]
    assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == [".metadata", "manifest.json"]
    with pytest.raises(peer.PeerUnavailable, match="has no 'absent'"):
        _fetch(server, tmp_path / "dest2", step=2, names=[".metadata", "absent"])
    with pytest.raises(peer.PeerUnavailable, match="requested names repeat"):
        _fetch(server, tmp_path / "dest3", step=2, names=[".metadata", ".metadata"])
    with peer.open_file(
        server.address,
        key=KEY,
        job_uid=JOB,
        source_rank=0,
        step=2,
        name="__0_0.distcp",
        deadline_s=30,
    ) as incoming:
        assert (incoming.size, incoming.crc32c) == layout.file_crc32c(files[0])
        buf = bytearray(incoming.size)
        incoming.chan.recv_into(memoryview(buf))
    assert bytes(buf) == files[0].read_bytes()


def test_client_without_the_key_is_refused(
    server: peer.ReplicaServer, tmp_path: pathlib.Path
) -> None:
    files = _files(tmp_path / "src", {"a": 10})
    with pytest.raises(peer.PeerUnavailable, match="did not prove"):
        _push(server, files, step=1, key=peer.derive_key(b"another key"))
    assert list(server.store.iterdir()) == []


def test_client_proof_checked_by_the_server(
    server: peer.ReplicaServer, tmp_path: pathlib.Path
) -> None:
    """A client that skips checking the server's proof still cannot pass its own."""
    chan = _raw_channel(server)
    with chan.sock:
        chan.send_msg({"op": "hello", "v": 1, "job_uid": JOB, "nonce": "0" * 32})
        chan.expect_ok("hello")
        chan.send_msg({"proof": "f" * 64})
        with pytest.raises(peer.PeerUnavailable, match="authentication failed"):
            chan.expect_ok("authentication")
    assert list(server.store.iterdir()) == []


def test_server_without_the_key_is_refused(tmp_path: pathlib.Path) -> None:
    impostor = peer.ReplicaServer(
        root=tmp_path / "impostor", key=peer.derive_key(b"other"), host="127.0.0.1"
    )
    with impostor:
        with pytest.raises(peer.PeerUnavailable, match="did not prove"):
            _fetch(impostor, tmp_path / "dest", step=1)
        with pytest.raises(peer.PeerUnavailable, match="did not prove"):
            _push(impostor, _files(tmp_path / "src", {"a": 10}), step=1)
    assert not (tmp_path / "dest").exists()
    assert list((tmp_path / "impostor" / "peer").iterdir()) == []


def test_other_job_refused(tmp_path: pathlib.Path) -> None:
    files = _files(tmp_path / "src", {"a": 10})
    bound = peer.ReplicaServer(root=tmp_path / "bound", key=KEY, host="127.0.0.1", job_uid=JOB)
    with bound, pytest.raises(peer.PeerUnavailable, match="another job"):
        _push(bound, files, step=1, job_uid="job-b-uid")
    shared = peer.ReplicaServer(root=tmp_path / "shared", key=KEY, host="127.0.0.1")
    with shared:
        _push(shared, files, step=1)
        with pytest.raises(peer.PeerUnavailable, match="another job"):
            _fetch(shared, tmp_path / "dest", step=1, job_uid="job-b-uid")


def _raw_channel(srv: peer.ReplicaServer) -> peerwire.Channel:
    sock = socket.create_connection(srv.address, timeout=5)
    deadline = peerwire.Deadline(30, what="test")
    return peerwire.Channel(sock, deadline=deadline, io_timeout=5, peer="test")


@pytest.mark.parametrize("name", ["../escape", "a/b", "..", "/abs", "", peerwire.REPLICA_META])
def test_server_refuses_names_that_are_not_plain(
    server: peer.ReplicaServer, tmp_path: pathlib.Path, name: str
) -> None:
    chan = _raw_channel(server)
    with chan.sock:
        peerwire.client_handshake(chan, key=KEY, job_uid=JOB)
        chan.send_msg(
            {"op": "push", "source_rank": 0, "step": 1, "files": [{"name": name, "size": 1}]}
        )
        with pytest.raises(peer.PeerUnavailable, match="not a plain base name"):
            chan.expect_ok("push")
    assert list(server.store.rglob("*")) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["srv"]


@pytest.mark.parametrize("name", ["../x", "a/b", "..", "a\\b", "x\x00"])
def test_client_refuses_a_servers_names_that_are_not_plain(name: str) -> None:
    entry = {"name": name, "size": 1, "crc32c": "00000000"}
    with pytest.raises(peer.PeerUnavailable, match="not a plain base name"):
        peer._file_list([entry], max_file_bytes=10)


def test_client_refuses_oversized_and_malformed_lists() -> None:
    with pytest.raises(peer.PeerUnavailable, match="size"):
        peer._file_list([{"name": "a", "size": 11, "crc32c": "00000000"}], max_file_bytes=10)
    with pytest.raises(peer.PeerUnavailable, match="size"):
        peer._file_list([{"name": "a", "size": True, "crc32c": "00000000"}], max_file_bytes=10)
    with pytest.raises(peer.PeerUnavailable, match="crc32c"):
        peer._file_list([{"name": "a", "size": 1, "crc32c": "xyz"}], max_file_bytes=10)
    with pytest.raises(peer.PeerUnavailable, match="repeat"):
        entry = {"name": "a", "size": 1, "crc32c": "00000000"}
        peer._file_list([entry, entry], max_file_bytes=10)


def test_server_refuses_a_file_over_its_cap(tmp_path: pathlib.Path) -> None:
    files = _files(tmp_path / "src", {"big": 1001})
    capped = peer.ReplicaServer(
        root=tmp_path / "srv", key=KEY, host="127.0.0.1", max_file_bytes=1000
    )
    with capped, pytest.raises(peer.PeerUnavailable, match="size 1001"):
        _push(capped, files, step=1)
    assert list(capped.store.rglob("*")) == []


def test_corrupt_stored_byte_detected_on_fetch(
    server: peer.ReplicaServer, tmp_path: pathlib.Path
) -> None:
    files = _files(tmp_path / "src", {"a": 1000, "b": 3 * 1024 * 1024})
    _push(server, files, step=4)
    stored = server.store / "rank-0" / "step-4" / "b"
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0x01
    stored.write_bytes(data)
    with pytest.raises(peer.PeerUnavailable, match="b crc32c"):
        _fetch(server, tmp_path / "dest", step=4)
    assert list((tmp_path / "dest").iterdir()) == []


class _FlipProxy:
    """Forwards one connection to `target`, flipping one bit of the byte at
    `offset` of the stream in one direction (`upstream`: client to server)."""

    def __init__(self, target: tuple[str, int], *, offset: int, upstream: bool) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address: tuple[str, int] = self.listener.getsockname()[:2]
        self._target = target
        self._flip = (offset, None) if upstream else (None, offset)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.listener.settimeout(30)
        with (
            self.listener,
            self.listener.accept()[0] as client,
            socket.create_connection(self._target, timeout=30) as server,
        ):
            client.settimeout(30)
            back = threading.Thread(target=self._pipe, args=(server, client, self._flip[1]))
            back.start()
            self._pipe(client, server, self._flip[0])
            back.join(30)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, flip_at: int | None) -> None:
        seen = 0
        with contextlib.suppress(OSError):
            while data := bytearray(src.recv(65536)):
                if flip_at is not None and seen <= flip_at < seen + len(data):
                    data[flip_at - seen] ^= 0x01
                dst.sendall(data)
                seen += len(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


@pytest.mark.parametrize("direction", ["push", "fetch"])
def test_byte_flipped_in_transit_detected(
    server: peer.ReplicaServer, tmp_path: pathlib.Path, direction: str
) -> None:
    files = _files(tmp_path / "src", {"a": 1024 * 1024})
    if direction == "fetch":
        _push(server, files, step=3)
    proxy = _FlipProxy(server.address, offset=500_000, upstream=direction == "push")
    common: dict[str, typing.Any] = {"key": KEY, "job_uid": JOB, "source_rank": 0, "step": 3}
    with pytest.raises(peer.PeerUnavailable, match="crc32c"):
        if direction == "push":
            peer.push(proxy.address, files=files, deadline_s=30, **common)
        else:
            peer.fetch(proxy.address, dest=tmp_path / "dest", deadline_s=30, **common)
    proxy.thread.join(30)
    if direction == "push":
        assert list(server.store.rglob("*")) == [server.store / "rank-0"]
    else:
        assert list((tmp_path / "dest").iterdir()) == []


def _bounded(call: typing.Callable[[], object], *, bound: float = 30) -> BaseException | None:
    """Run `call` in a thread; it must return within `bound` s (a hang fails the
    test instead of the suite). Returns what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the test
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(bound)
    assert not thread.is_alive(), "the call did not return (a hang)"
    return raised[0] if raised else None


def test_silent_peer_fails_in_bounded_time(tmp_path: pathlib.Path) -> None:
    """A listening socket nobody serves: the kernel accepts, nothing answers
    (what a SIGSTOPped peer looks like)."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        address = silent.getsockname()[:2]
        files = _files(tmp_path / "src", {"a": 10})
        common: dict[str, typing.Any] = {"key": KEY, "job_uid": JOB, "source_rank": 0, "step": 1}
        pushed = _bounded(
            lambda: peer.push(address, files=files, deadline_s=2, io_timeout_s=0.5, **common)
        )
        fetched = _bounded(
            lambda: peer.fetch(address, dest=tmp_path / "d", deadline_s=0.7, **common)
        )
    assert isinstance(pushed, peer.PeerUnavailable)
    assert "timed out" in str(pushed)
    assert isinstance(fetched, peer.PeerUnavailable)


def test_client_that_stops_sending_is_dropped(server: peer.ReplicaServer) -> None:
    chan = _raw_channel(server)
    with chan.sock:
        peerwire.client_handshake(chan, key=KEY, job_uid=JOB)
        chan.send_msg(
            {"op": "push", "source_rank": 0, "step": 1, "files": [{"name": "a", "size": 10**6}]}
        )
        chan.expect_ok("push")
        chan.send(b"0123456789")
        # The server's read times out (io_timeout_s=1): it closes the connection.
        chan.sock.settimeout(30)
        assert chan.sock.recv(1) == b""
    deadline = time.monotonic() + 30
    while list(server.store.rglob("*")) != [server.store / "rank-0"]:
        assert time.monotonic() < deadline, "the unfinished push was not dropped"
        time.sleep(0.05)


def test_silent_client_dropped_before_authentication(tmp_path: pathlib.Path) -> None:
    """A party that connects and never says hello holds a server slot only
    for the handshake deadline."""
    srv = peer.ReplicaServer(
        root=tmp_path / "srv", key=KEY, host="127.0.0.1", handshake_deadline_s=0.5
    )
    with srv, socket.create_connection(srv.address, timeout=30) as sock:
        assert sock.recv(1) == b""  # closed by the server, not by this timeout


def test_push_refuses_the_callers_bad_files(
    server: peer.ReplicaServer, tmp_path: pathlib.Path
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    twice = [*_files(tmp_path / "a", {"x": 1}), *_files(tmp_path / "b", {"x": 1})]
    with pytest.raises(ValueError, match="repeat"):
        _push(server, twice, step=1)
    with pytest.raises(ValueError, match="plain base name"):
        _push(server, _files(tmp_path / "c", {peerwire.REPLICA_META: 1}), step=1)


@pytest.mark.parametrize(
    ("field", "value"), [("step", -1), ("step", "7"), ("source_rank", True), ("source_rank", 2**40)]
)
def test_server_refuses_bad_rank_or_step(
    server: peer.ReplicaServer, field: str, value: object
) -> None:
    chan = _raw_channel(server)
    with chan.sock:
        peerwire.client_handshake(chan, key=KEY, job_uid=JOB)
        chan.send_msg({"op": "fetch", "source_rank": 0, "step": 1, field: value})
        with pytest.raises(peer.PeerUnavailable, match="is not an integer"):
            chan.expect_ok("fetch")


def test_newer_step_replaces_older(server: peer.ReplicaServer, tmp_path: pathlib.Path) -> None:
    old = _files(tmp_path / "s1", {"a": 100})
    new = _files(tmp_path / "s2", {"a": 200})
    _push(server, old, step=1)
    _push(server, new, step=2)
    assert [p.name for p in (server.store / "rank-0").iterdir()] == ["step-2"]
    with pytest.raises(peer.PeerUnavailable, match="no usable replica"):
        _fetch(server, tmp_path / "d1", step=1)
    with pytest.raises(peer.PeerUnavailable, match="older than the held step 2"):
        _push(server, old, step=1)
    _fetch(server, tmp_path / "d2", step=2)
    assert (tmp_path / "d2" / "a").read_bytes() == new[0].read_bytes()


def test_concurrent_pushes_newest_wins(server: peer.ReplicaServer, tmp_path: pathlib.Path) -> None:
    files = {step: _files(tmp_path / f"s{step}", {"a": 4 * 1024 * 1024}) for step in (5, 6)}
    results: list[BaseException | None] = [None, None]

    def run(i: int, step: int) -> None:
        results[i] = _bounded(lambda: _push(server, files[step], step=step))

    threads = [threading.Thread(target=run, args=(i, s)) for i, s in enumerate((5, 6))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results[1] is None  # the newer step is always stored
    assert [p.name for p in (server.store / "rank-0").iterdir()] == ["step-6"]
    _fetch(server, tmp_path / "d", step=6)
    assert (tmp_path / "d" / "a").read_bytes() == files[6][0].read_bytes()


def test_derive_key() -> None:
    assert peer.derive_key(b"k") == peer.derive_key(b"k")
    assert peer.derive_key(b"k") != peer.derive_key(b"l")
    assert len(peer.derive_key(b"k")) == 32
    assert peer.derive_key(b"k") != b"k"
