"""The operator's S3 clients: one per (endpoint, region, key pair), bounded in every call.

Blocking builds (boto3); no credential is read here (``s3observe.credentials``
reads the Secret and hands the pair in). ``ClientCache`` keeps built clients
(building one costs ~135 ms of CPU); its keys hold the secret key only as a
SHA-256 digest. ``s3observe`` re-exports these names and holds the
operator's one cache (``s3observe.CLIENTS``).
"""

from __future__ import annotations

import collections
import hashlib
import threading
import typing

import boto3
import botocore.config
import botocore.session

from cairn.api import checkpointspec
from cairn.operator.core import tunables

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client


def make_client(
    upload: checkpointspec.UploadSpec,
    *,
    access_key: str | None,
    secret_key: str | None,
    bounds: tunables.S3 = tunables.DEFAULT.s3,
) -> S3Client:
    """A new S3 client for the job's store, with bounded retries and timeouts."""
    config = botocore.config.Config(
        region_name=upload.region or bounds.default_region,
        connect_timeout=bounds.connect_timeout_seconds,
        read_timeout=bounds.read_timeout_seconds,
        retries={"max_attempts": bounds.max_attempts, "mode": "standard"},
        # As the writer: checksums where an operation needs one (some
        # S3-compatible stores reject the default trailing checksums).
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        # Custom endpoints (MinIO, SeaweedFS) want path-style addressing.
        s3={"addressing_style": "path" if upload.endpoint else "auto"},
    )
    # The operator reads no timestamp from S3 answers, and parsing them is most
    # of botocore's cost for a listing (a 1,000-key page: 84 -> 23 ms of CPU,
    # measured): they stay strings.
    core = botocore.session.get_session()
    core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=str)
    session = boto3.session.Session(
        aws_access_key_id=access_key, aws_secret_access_key=secret_key, botocore_session=core
    )
    s3: S3Client = session.client("s3", endpoint_url=upload.endpoint, config=config)
    return s3


ClientKey = tuple[str, str, str, str]
"""(endpoint, region, access key id, SHA-256 of the secret key)."""


def client_key(
    upload: checkpointspec.UploadSpec,
    *,
    access_key: str | None,
    secret_key: str | None,
    bounds: tunables.S3 = tunables.DEFAULT.s3,
) -> ClientKey:
    """What makes two clients interchangeable. Pure. The secret key enters only
    as a digest, so the cache's keys hold no credential."""
    digest = hashlib.sha256((secret_key or "").encode()).hexdigest()
    region = upload.region or bounds.default_region
    return (upload.endpoint or "", region, access_key or "", digest)


class ClientCache:
    """S3 clients by ``client_key``, least recently used dropped past ``limit``.

    boto3 clients are thread-safe; building one is not cheap (~135 ms of
    CPU). A Secret rotated to a new key pair maps to a new key, hence a new
    client on the next pass; the old client ages out.
    """

    def __init__(self, limit: int = tunables.DEFAULT.s3.client_cache_entries) -> None:
        self._clients: collections.OrderedDict[ClientKey, S3Client] = collections.OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()
        self.builds = 0
        """Clients built so far (for tests and the bench)."""

    def get(
        self,
        upload: checkpointspec.UploadSpec,
        *,
        access_key: str | None,
        secret_key: str | None,
        bounds: tunables.S3 = tunables.DEFAULT.s3,
    ) -> S3Client:
        key = client_key(upload, access_key=access_key, secret_key=secret_key, bounds=bounds)
        with self._lock:
            found = self._clients.get(key)
            if found is not None:
                self._clients.move_to_end(key)
                return found
        built = make_client(upload, access_key=access_key, secret_key=secret_key, bounds=bounds)
        with self._lock:
            self.builds += 1
            self._clients[key] = built
            while len(self._clients) > self._limit:
                self._clients.popitem(last=False)
        return built
