"""A loopback TCP proxy in front of the real S3 server that can hang or throttle.

Test helper for brownouts. Bytes are forwarded unchanged in both directions
(so SigV4 and checksums stay valid); `hold()` stops forwarding without
closing anything: connections stay open and new ones are accepted, so
clients block in send/recv exactly as with a SIGSTOPped server whose kernel
still accepts (its listening socket keeps accepting into the kernel backlog:
measured on this project's devcluster). `release()` forwards again,
including what was held. `throttle(bytes_per_second)` caps each direction
of each connection. Only the timing is fake; every byte is the server's.
Runs in daemon threads of the test process; `close()` stops it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import urllib.parse

CHUNK = 16 * 1024


class HoldProxy:
    def __init__(self, upstream: str) -> None:
        parsed = urllib.parse.urlparse(upstream)
        self.upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self._flowing = threading.Event()
        self._flowing.set()
        self._rate: float | None = None
        self._closed = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self._listener.settimeout(0.2)
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="hold-proxy", daemon=True).start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def hold(self) -> None:
        """Stop forwarding bytes (connections stay open; new ones are accepted)."""
        self._flowing.clear()

    def release(self) -> None:
        """Forward again, at full speed."""
        self._rate = None
        self._flowing.set()

    def throttle(self, bytes_per_second: float) -> None:
        """Forward at most this many bytes per second per direction and connection."""
        self._rate = bytes_per_second
        self._flowing.set()

    def close(self) -> None:
        self._closed.set()
        self._flowing.set()
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()

    def __enter__(self) -> HoldProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                # Held: read nothing, so the sender's buffers fill and it blocks.
                self._flowing.wait()
                rate = self._rate
                data = src.recv(CHUNK if rate is None else max(1, min(CHUNK, int(rate / 4))))
                if not data:
                    break
                self._flowing.wait()
                if rate is not None:
                    time.sleep(len(data) / rate)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
