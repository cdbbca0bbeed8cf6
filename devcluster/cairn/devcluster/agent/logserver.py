"""The kubelet log endpoint, so `kubectl logs` works through the apiserver.

One HTTPS server per node on 127.0.0.1:<kubeletEndpoint port>, with the
kubelet serving certificate, requiring a client certificate signed by the
cluster CA (the apiserver's kubelet client). It serves
`GET /containerLogs/<ns>/<pod>/<container>` with `follow`, `tailLines`,
`limitBytes` and `previous`, reading the per-restart log files the pod
worker writes.
"""

import http.server
import pathlib
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable

LogDirLookup = Callable[[str, str], pathlib.Path | None]
FollowAlive = Callable[[str, str, str], bool]


def _files(log_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted(log_dir.glob("*.log"), key=lambda p: int(p.stem))


def make_server(
    *,
    port: int,
    pki: pathlib.Path,
    lookup: LogDirLookup,
    running: FollowAlive,
) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            return

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            parts = url.path.strip("/").split("/")
            query = urllib.parse.parse_qs(url.query)
            if len(parts) != 4 or parts[0] != "containerLogs":
                self.send_error(404, "only /containerLogs/<ns>/<pod>/<container> is served")
                return
            _, namespace, pod, container = parts
            pod_dir = lookup(namespace, pod)
            log_dir = pod_dir / "logs" / container if pod_dir else None
            files = _files(log_dir) if log_dir and log_dir.exists() else []
            if not files:
                self.send_error(
                    404, f"no logs for container {container!r} of pod {namespace}/{pod}"
                )
                return
            previous = query.get("previous", ["false"])[0] == "true"
            if previous and len(files) < 2:
                self.send_error(400, f"previous terminated container {container!r} not found")
                return
            path = files[-2] if previous else files[-1]
            data = path.read_bytes()
            if "tailLines" in query:
                lines = data.splitlines(keepends=True)
                data = (
                    b"".join(lines[-int(query["tailLines"][0]) :])
                    if int(query["tailLines"][0])
                    else b""
                )
            if "limitBytes" in query:
                data = data[: int(query["limitBytes"][0])]
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
            if query.get("follow", ["false"])[0] != "true" or previous:
                return
            offset = path.stat().st_size
            while True:
                # Ask before reading: what the container wrote before it ended
                # is still sent, and the stream ends with the container (as
                # the kubelet's does), not with the pod object.
                alive = running(namespace, pod, container)
                size = path.stat().st_size
                if size > offset:
                    with path.open("rb") as handle:
                        handle.seek(offset)
                        chunk = handle.read(size - offset)
                    offset = size
                    try:
                        self.wfile.write(chunk)
                        self.wfile.flush()
                    except OSError:
                        return
                elif not alive:
                    return
                time.sleep(0.2)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(pki / "kubelet.crt"), str(pki / "kubelet.key"))
    context.load_verify_locations(str(pki / "ca.crt"))
    context.verify_mode = ssl.CERT_REQUIRED
    server.socket = context.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    return server


def serve_in_background(server: http.server.ThreadingHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, name="kubelet-logs", daemon=True)
    thread.start()
    return thread
