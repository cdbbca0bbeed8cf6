"""A throwaway SeaweedFS S3 server for tests that need S3 but no cluster.

Same server and flags as the devcluster's (`s3.command`), in its own
temporary directory and ports, started and stopped by PID.
"""

import dataclasses
import pathlib
import socket
import time
import urllib.error
import urllib.request
import uuid

from cairn.devcluster import errors, processes, s3

START_TIMEOUT_SECONDS = 60.0


@dataclasses.dataclass(kw_only=True)
class S3Server:
    """A running S3 server: endpoint, keys, and a way to get a fresh bucket."""

    endpoint_url: str
    access_key: str
    secret_key: str
    region: str
    root: pathlib.Path
    ports: s3.S3Ports
    tracked: processes.Tracked

    def client(self) -> object:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
        )

    def new_bucket(self, prefix: str) -> str:
        name = f"{prefix[:40]}-{uuid.uuid4().hex[:12]}".lower().replace("_", "-")
        self.client().create_bucket(Bucket=name)  # type: ignore[attr-defined]
        return name

    def stop(self) -> None:
        processes.stop(self.tracked, grace_seconds=15.0)
        for sock in s3.stray_sockets(self.ports):
            sock.unlink(missing_ok=True)


def _ready(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(endpoint + "/status", timeout=2) as resp:
            return int(resp.status) < 500
    except urllib.error.HTTPError as exc:
        return exc.code < 500
    except (urllib.error.URLError, OSError):
        return False


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_base_port(start: int) -> int:
    """The first S3 port from `start` (in steps of 10) whose every port is free.

    Concurrent test sessions each get their own server instead of silently
    talking to another session's (with other credentials).
    """
    for base in range(start, start + 2000, 10):
        if all(_free(p) for p in s3.S3Ports(s3=base).all):
            return base
    raise errors.DevclusterError(f"no free port range for an S3 server from {start}")


def start(*, root: pathlib.Path, s3_port: int) -> S3Server:
    """Start a server on the first free port range at or above `s3_port`."""
    s3_port = free_base_port(s3_port)
    ports = s3.S3Ports(s3=s3_port)
    argv = s3.command(data_dir=root, log_dir=root / "logs", ports=ports, bind="127.0.0.1")
    tracked = processes.spawn(
        name="s3", argv=argv, log_path=root / "s3.log", pidfile=root / "s3.pid", cwd=root
    )
    creds = s3.ensure_credentials(root)
    server = S3Server(
        endpoint_url=f"http://127.0.0.1:{s3_port}",
        access_key=creds.access_key,
        secret_key=creds.secret_key,
        region=s3.REGION,
        root=root,
        ports=ports,
        tracked=tracked,
    )
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        if not processes.is_alive(tracked):
            raise errors.DevclusterError(f"the S3 server exited at start; see {root / 's3.log'}")
        if _ready(server.endpoint_url):
            return server
        time.sleep(0.2)
    server.stop()
    raise errors.DevclusterError(f"the S3 server did not answer in time; see {root / 's3.log'}")
