"""The peer replica protocol's wire: frames, deadlines, the mutual handshake, name checks.

Used by `cairn.checkpoint.peer` (the server and the two client calls) on
both ends; nothing here knows about replicas or files on disk.

    frame      4-byte big-endian length, then that many bytes of UTF-8 JSON
               (an object; at most `MAX_HEADER` bytes). Never pickle.
    raw bytes  file contents follow a header that announced their sizes.

Handshake (`client_handshake` / `server_handshake`), before any data moves:

    C -> S  {"op": "hello", "v": 1, "job_uid": U, "nonce": Nc}
    S -> C  {"ok": true, "nonce": Ns, "proof": mac(K, "server", U, Nc, Ns)}
    C -> S  {"proof": mac(K, "client", U, Nc, Ns)}
    S -> C  {"ok": true, "mac": ...}          (or {"ok": false, "error": ...})

Each side checks the other's proof with `hmac.compare_digest`, so neither
a client nor a server without the key K (`peer.derive_key` of the job's
manifest key) gets past it, and both proofs bind the job UID U and fresh
nonces (no replay). Every later header carries `mac`: HMAC-SHA256 of its
canonical JSON under a session key derived from the same inputs, so a
header cannot be injected into an authenticated connection. File bytes are
checked by CRC32C (against accidents, as everywhere in Cairn), not by a MAC.

Every socket operation runs under `Channel`: a per-operation timeout capped
by a whole-transfer deadline; what passes either raises `PeerUnavailable`
in bounded time.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import secrets
import socket
import struct
import time
import typing

VERSION = 1
MAX_HEADER = 1024 * 1024
"""Largest JSON header accepted (a file list of thousands of entries fits)."""
CHUNK = 8 * 1024 * 1024
"""Bytes per read/write of file contents: files are streamed, never held."""
REPLICA_META = ".cairn-replica.json"
"""The replica's own record inside its folder; no pushed file may take the name."""
_LABEL = b"cairn-peer-v1"
_LENGTH = struct.Struct(">I")


class PeerUnavailable(Exception):  # noqa: N818 - the name is the contract with memtier
    """The peer tier failed (unreachable, refused, slow, corrupt, absent): the
    caller treats it as "use the next tier". The message says why."""


class Deadline:
    """A whole-transfer deadline (monotonic clock) that caps every operation."""

    def __init__(self, seconds: float, *, what: str) -> None:
        self._end = time.monotonic() + seconds
        self._seconds = seconds
        self._what = what

    def timeout(self, cap: float) -> float:
        """Seconds the next operation may take: `cap`, or less near the end."""
        left = self._end - time.monotonic()
        if left <= 0:
            raise PeerUnavailable(f"{self._what}: deadline of {self._seconds:g}s passed")
        return min(cap, left)


class Channel:
    """One connection with bounded operations; every failure is PeerUnavailable."""

    def __init__(
        self, sock: socket.socket, *, deadline: Deadline, io_timeout: float, peer: str
    ) -> None:
        self.sock = sock
        self.deadline = deadline
        self.io_timeout = io_timeout
        self.peer = peer
        self.session_key: bytes | None = None

    def _arm(self) -> None:
        self.sock.settimeout(self.deadline.timeout(self.io_timeout))

    def send(self, data: bytes | memoryview) -> None:
        self._arm()
        try:
            self.sock.sendall(data)  # the timeout bounds the whole sendall
        except OSError as exc:
            raise PeerUnavailable(f"{self.peer}: send failed: {exc!r}") from exc

    def sendfile(self, stream: typing.BinaryIO, size: int) -> None:
        """Send exactly `size` bytes of `stream` from its start, kernel to socket
        (`socket.sendfile`), a chunk per bounded operation."""
        sent = 0
        while sent < size:
            self._arm()
            try:
                n = self.sock.sendfile(stream, sent, min(CHUNK, size - sent))
            except OSError as exc:
                raise PeerUnavailable(f"{self.peer}: send failed: {exc!r}") from exc
            if n == 0:
                raise PeerUnavailable(f"{self.peer}: the file ended {size - sent} bytes early")
            sent += n

    def recv_into(self, view: memoryview) -> None:
        """Fill `view` completely (EOF first is PeerUnavailable)."""
        got = 0
        while got < len(view):
            self._arm()
            try:
                n = self.sock.recv_into(view[got:])
            except OSError as exc:
                raise PeerUnavailable(f"{self.peer}: receive failed: {exc!r}") from exc
            if n == 0:
                raise PeerUnavailable(f"{self.peer}: connection closed mid-message")
            got += n

    def send_msg(self, msg: dict[str, typing.Any]) -> None:
        body = dict(msg)
        if self.session_key is not None:
            body["mac"] = _header_mac(self.session_key, msg)
        data = json.dumps(body, separators=(",", ":")).encode()
        self.send(_LENGTH.pack(len(data)) + data)

    def recv_msg(self) -> dict[str, typing.Any]:
        """The next header: a JSON object (MAC checked once a session exists)."""
        head = bytearray(_LENGTH.size)
        self.recv_into(memoryview(head))
        (length,) = _LENGTH.unpack(head)
        if length > MAX_HEADER:
            raise PeerUnavailable(f"{self.peer}: header of {length} bytes is over {MAX_HEADER}")
        data = bytearray(length)
        self.recv_into(memoryview(data))
        try:
            msg = json.loads(data)
        except ValueError as exc:
            raise PeerUnavailable(f"{self.peer}: header is not JSON") from exc
        if not isinstance(msg, dict):
            raise PeerUnavailable(f"{self.peer}: header is not a JSON object")
        if self.session_key is not None:
            mac = msg.pop("mac", None)
            if not isinstance(mac, str) or not hmac.compare_digest(
                mac, _header_mac(self.session_key, msg)
            ):
                raise PeerUnavailable(f"{self.peer}: header MAC does not verify")
        return msg

    def expect_ok(self, what: str) -> dict[str, typing.Any]:
        msg = self.recv_msg()
        if msg.get("ok") is not True:
            raise PeerUnavailable(f"{self.peer}: {what} refused: {str(msg.get('error'))[:200]}")
        return msg


def _mac(key: bytes, role: str, *parts: str) -> str:
    data = b"\0".join([_LABEL, role.encode(), *(p.encode() for p in parts)])
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def _header_mac(session_key: bytes, msg: dict[str, typing.Any]) -> str:
    canonical = json.dumps(msg, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(session_key, canonical, hashlib.sha256).hexdigest()


def _session_key(key: bytes, job_uid: str, nonce_c: str, nonce_s: str) -> bytes:
    return bytes.fromhex(_mac(key, "session", job_uid, nonce_c, nonce_s))


def client_handshake(chan: Channel, *, key: bytes, job_uid: str) -> None:
    """Prove the key to the server and check the server's proof first."""
    nonce_c = secrets.token_hex(16)
    chan.send_msg({"op": "hello", "v": VERSION, "job_uid": job_uid, "nonce": nonce_c})
    reply = chan.expect_ok("hello")
    nonce_s = reply.get("nonce")
    proof = reply.get("proof")
    if not isinstance(nonce_s, str) or len(nonce_s) != 32 or not isinstance(proof, str):
        raise PeerUnavailable(f"{chan.peer}: malformed handshake reply")
    if not hmac.compare_digest(proof, _mac(key, "server", job_uid, nonce_c, nonce_s)):
        raise PeerUnavailable(f"{chan.peer}: the server did not prove the job's key")
    chan.send_msg({"proof": _mac(key, "client", job_uid, nonce_c, nonce_s)})
    chan.session_key = _session_key(key, job_uid, nonce_c, nonce_s)
    chan.expect_ok("authentication")


def server_handshake(chan: Channel, *, key: bytes, job_uid: str | None) -> str:
    """Check a client's hello and proof; returns its (authenticated) job UID.
    Raises PeerUnavailable (after telling the client why) when refused."""
    hello = chan.recv_msg()
    uid = hello.get("job_uid")
    nonce_c = hello.get("nonce")
    if hello.get("op") != "hello" or hello.get("v") != VERSION:
        refuse(chan, "expected hello of protocol version 1")
    if not isinstance(uid, str) or not uid or len(uid) > 256:
        refuse(chan, "job_uid missing or malformed")
    if not isinstance(nonce_c, str) or len(nonce_c) != 32:
        refuse(chan, "nonce missing or malformed")
    if job_uid is not None and uid != job_uid:
        refuse(chan, "this replica server serves another job")
    nonce_s = secrets.token_hex(16)
    chan.send_msg(
        {"ok": True, "nonce": nonce_s, "proof": _mac(key, "server", uid, nonce_c, nonce_s)}
    )
    answer = chan.recv_msg()
    proof = answer.get("proof")
    if not isinstance(proof, str) or not hmac.compare_digest(
        proof, _mac(key, "client", uid, nonce_c, nonce_s)
    ):
        refuse(chan, "authentication failed")
    chan.session_key = _session_key(key, uid, nonce_c, nonce_s)
    chan.send_msg({"ok": True})
    return uid


def refuse(chan: Channel, reason: str) -> typing.NoReturn:
    """Tell the other side why (best effort), then fail this connection."""
    with contextlib.suppress(PeerUnavailable):
        chan.send_msg({"ok": False, "error": reason})
    raise PeerUnavailable(f"{chan.peer}: refused: {reason}")


def check_name(name: object) -> str:
    """A file name as the protocol allows it: a plain base name (no `/`, `\\`,
    `..`, NUL or control characters; not the replica record). Pure."""
    if (
        not isinstance(name, str)
        or not name
        or len(name.encode()) > 200
        or name in (".", REPLICA_META)
        or ".." in name
        or any(c in name for c in "/\\")
        or any(ord(c) < 32 for c in name)
    ):
        raise PeerUnavailable(f"file name {str(name)[:80]!r} is not a plain base name")
    return name


def check_count(value: object, *, what: str, limit: int) -> int:
    """A non-negative int (not a bool) at most `limit`. Pure."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise PeerUnavailable(f"{what} {str(value)[:40]} is not an integer in [0, {limit}]")
    return value


def check_crc(value: object) -> str:
    """A CRC32C as 8 lowercase hex digits. Pure."""
    if not isinstance(value, str) or len(value) != 8 or value.strip("0123456789abcdef"):
        raise PeerUnavailable(f"crc32c {str(value)[:20]!r} is not 8 hex digits")
    return value
