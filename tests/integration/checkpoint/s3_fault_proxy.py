"""A loopback HTTP proxy in front of the real S3 server that injects transport faults.

Test helper. Requests are forwarded unchanged (headers included, so SigV4
signatures stay valid) to the upstream S3 server; the answers come back
unchanged, except for requests whose path contains `match`: the first
`fail_first` of those (or all of them, `fail_first=None`) get a fault
instead, cycling through `modes`:

    503       503 SlowDown (throttling)
    500       500 InternalError
    reset     the connection is closed without an answer
    truncate  the upstream answer's headers and half of its body, then close

Only the fault is fake; every byte that arrives comes from the real server.
Runs in a daemon thread of the test process; `close()` stops it.
"""

from __future__ import annotations

import http.client
import http.server
import itertools
import socket
import struct
import threading
import urllib.parse

HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "proxy-connection"}


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        return  # a connection we reset on purpose ends with an error; not news


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        *,
        match: str,
        fail_first: int | None,
        modes: tuple[str, ...] = ("503", "reset", "500", "truncate"),
    ) -> None:
        parsed = urllib.parse.urlparse(upstream)
        self.upstream_host = parsed.hostname or "127.0.0.1"
        self.upstream_port = parsed.port or 80
        self.match = match
        self.fail_first = fail_first
        self.modes = itertools.cycle(modes)
        self.lock = threading.Lock()
        self.matched = 0
        self.injected: list[str] = []
        self.server = _QuietServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fault_for(self, path: str) -> str | None:
        if self.match not in path:
            return None
        with self.lock:
            self.matched += 1
            if self.fail_first is not None and self.matched > self.fail_first:
                return None
            mode = next(self.modes)
            self.injected.append(mode)
            return mode

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                return  # quiet

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                mode = proxy._fault_for(self.path)
                if mode in ("503", "500"):
                    self._error(mode)
                    return
                if mode == "reset":
                    self._reset()
                    return
                upstream = http.client.HTTPConnection(
                    proxy.upstream_host, proxy.upstream_port, timeout=60
                )
                try:
                    headers = {
                        k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS
                    }
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    answer = upstream.getresponse()
                    data = answer.read()
                finally:
                    upstream.close()
                self.send_response_only(answer.status, answer.reason)
                for name, value in answer.getheaders():
                    if name.lower() not in HOP_HEADERS and name.lower() != "content-length":
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if mode == "truncate" and self.command == "GET" and len(data) > 1:
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self._reset()
                    return
                if self.command != "HEAD":
                    self.wfile.write(data)

            def _error(self, mode: str) -> None:
                code, status = ("SlowDown", 503) if mode == "503" else ("InternalError", 500)
                body = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
                self.send_response_only(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _reset(self) -> None:
                # SO_LINGER 0: close sends RST, as a dropped connection does.
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                self.close_connection = True
                self.connection.close()

            # http.server dispatches on these names.
            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward  # noqa: N815

        return Handler
