"""Observe step of the S3 pass: clients, credentials, list, head, read manifests.

Blocking (boto3 and the Kubernetes client): call from a worker thread. Reads
only: the decisions are in ``s3plan`` (pure), the deletions in ``s3apply``,
the pass that ties them together in ``s3pass``. Layout (the writer's,
``cairn.checkpoint.remote``): ``s3://bucket/<prefix>/step-<N, 9 digits>/<files>``
with ``manifest.json`` written last.

Credentials: the Secret named by ``upload.credentialsSecretRef`` in the job's
namespace is read at call time (RBAC: ``get`` on secrets, nothing else) and
its values go only into a boto3 client; they are never logged, put in an
event or stored outside process memory. Without a reference, boto3's default
chain applies (e.g. workload identity). Retries: botocore standard mode with
a bounded number of attempts and socket timeouts, so one call is bounded.

The job's manifest keyring (``manifest_keyring``) is read the same way, from
the Secret the operator created for the job (``<job>-manifest-key``, owned by
the job), so the plan can check manifest signatures; its keys go only into
``cairn.api.manifest.Keyring`` (whose repr hides them).

Costs, per pass of one job: two Secret GETs, one LIST of the prefix. Clients
are cached per (endpoint, region, key pair) (``ClientCache``: building one
costs ~135 ms of CPU), so a rotated Secret gets a new client on the next
pass and an unchanged one none. A manifest is read (GET) and a listed file
headed only when its (key, ETag) is new to the job's ``Caches``: an
unchanged prefix costs the LIST alone.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import hashlib
import threading
import typing
from typing import Any, Generic, TypeVar

import boto3
import botocore.config
import botocore.exceptions
import pydantic
from kubernetes.client import exceptions as k8s_exceptions

from cairn.api import checkpointspec, podenv
from cairn.api import manifest as manifest_mod
from cairn.operator import kubeapi
from cairn.operator.core import names, s3plan, tunables

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client


class StoreError(Exception):
    """Reading or changing the prefix failed; the message carries no secrets."""


ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)
"""What a boto3 call raises when the store or the network fails."""


def failure(what: str, error: Exception) -> StoreError:
    """A ``StoreError`` naming the call and the S3 error code (never a credential)."""
    if isinstance(error, botocore.exceptions.ClientError):
        code = error.response.get("Error", {}).get("Code", "?")
        return StoreError(f"{what} failed: {code}")
    return StoreError(f"{what} failed: {type(error).__name__}: {error}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Target:
    """The job's prefix: ``s3://bucket/prefix``."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, uri: str) -> Target:
        bucket, prefix = checkpointspec.split_s3_uri(uri)
        if not bucket or not uri.startswith("s3://"):
            raise StoreError(f"not an s3:// URI: {uri!r}")
        return cls(bucket=bucket, prefix=prefix)

    @property
    def base(self) -> str:
        """Key prefix of the job's objects, with a trailing slash (or empty)."""
        return f"{self.prefix}/" if self.prefix else ""

    def key(self, step: int, path: str) -> str:
        return f"{self.base}{manifest_mod.step_dir_name(step)}/{path}"


def _secret_value(data: dict[str, str], key: str, name: str) -> str:
    if key not in data:
        raise StoreError(f"Secret {name} has no key {key}")
    return base64.b64decode(data[key]).decode()


_last_good: dict[str, tuple[str, str]] = {}
"""Process memory only: the key pair last read for a job (by uid), so that the
``onDelete`` cleanup still works when the Secret went first (a namespace
deletion removes both at once). Never logged, never stored."""


def forget_credentials(job_uid: str) -> None:
    _last_good.pop(job_uid, None)


def manifest_keyring(
    api: kubeapi.KubeApi, *, job: str, namespace: str, job_uid: str
) -> manifest_mod.Keyring | None:
    """The job's manifest keyring from its Secret; None when there is none (404).

    None means the job predates the Secret (its pods never signed): the plan
    then judges manifests by job UID alone. A Secret that is not owned by
    this job (a same-named leftover of a deleted job, or a planted one), is
    unreadable or malformed raises ``StoreError`` (no key bytes in the
    message), and the pass deletes nothing.
    """
    name = names.manifest_key_secret_name(job)
    try:
        secret = api.core.read_namespaced_secret(name, namespace)
    except k8s_exceptions.ApiException as error:
        if error.status == 404:
            return None
        raise StoreError(
            f"reading Secret {namespace}/{name} failed: {error.status} {error.reason}"
        ) from None
    owners = secret.metadata.owner_references or ()
    if not any(ref.uid == job_uid and ref.controller for ref in owners):
        raise StoreError(f"Secret {namespace}/{name} is not owned by this job; not used")
    data: dict[str, str] = secret.data or {}
    try:
        return manifest_mod.parse_keyring(_secret_value(data, podenv.MANIFEST_KEYRING_FILE, name))
    except ValueError as error:
        raise StoreError(f"Secret {namespace}/{name}: {error}") from None


def credentials(
    api: kubeapi.KubeApi, namespace: str, ref: checkpointspec.SecretRef | None, *, job_uid: str = ""
) -> tuple[str | None, str | None]:
    """The access key pair from the referenced Secret (read now), or (None, None).

    With ``job_uid``, a pair read before is remembered in process memory and
    used when the Secret is gone (404).
    """
    if ref is None:
        return None, None
    try:
        secret = api.core.read_namespaced_secret(ref.name, namespace)
    except k8s_exceptions.ApiException as error:
        if error.status == 404 and job_uid in _last_good:
            return _last_good[job_uid]
        raise StoreError(
            f"reading Secret {namespace}/{ref.name} failed: {error.status} {error.reason}"
        ) from None
    data: dict[str, str] = secret.data or {}
    pair = (
        _secret_value(data, ref.access_key_id_key, ref.name),
        _secret_value(data, ref.secret_access_key_key, ref.name),
    )
    if job_uid:
        _last_good[job_uid] = pair
    return pair


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
    session = boto3.session.Session(aws_access_key_id=access_key, aws_secret_access_key=secret_key)
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


CLIENTS = ClientCache()
"""The operator's clients (one process, every job)."""


def client_for(
    api: kubeapi.KubeApi,
    namespace: str,
    upload: checkpointspec.UploadSpec,
    *,
    job_uid: str = "",
    cache: ClientCache | None = None,
) -> S3Client:
    """The job's client: its Secret read now, the client reused while the pair holds
    (``cache``: ``CLIENTS``, looked up at call time)."""
    access, secret = credentials(api, namespace, upload.credentials_secret_ref, job_uid=job_uid)
    return (cache or CLIENTS).get(upload, access_key=access, secret_key=secret)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Listed:
    size: int
    etag: str


def list_steps(s3: S3Client, target: Target) -> dict[int, dict[str, Listed]]:
    """Every object under ``<prefix>/step-<N>/``, by step and relative path."""
    return _list(s3, target)[0]


def _list(s3: S3Client, target: Target) -> tuple[dict[int, dict[str, Listed]], frozenset[int]]:
    """``list_steps``, plus the steps named by a manifest moved aside under
    ``<prefix>/.cairn/<kind>/<tag>/step-<N>/manifest.json``."""
    steps: dict[int, dict[str, Listed]] = {}
    aside: set[int] = set()
    try:
        pages = s3.get_paginator("list_objects_v2").paginate(
            Bucket=target.bucket, Prefix=target.base
        )
        for page in pages:
            for obj in page.get("Contents", []):
                rest = obj["Key"][len(target.base) :]
                folder, _, path = rest.partition("/")
                if folder == ".cairn":
                    parts = path.split("/")
                    if len(parts) >= 2 and parts[-1] == manifest_mod.MANIFEST_NAME:
                        moved = manifest_mod.parse_step_dir_name(parts[-2])
                        if moved is not None:
                            aside.add(moved)
                    continue
                step = manifest_mod.parse_step_dir_name(folder)
                if step is None or not path:
                    continue
                steps.setdefault(step, {})[path] = Listed(
                    size=int(obj.get("Size", 0)), etag=str(obj.get("ETag", ""))
                )
    except ERRORS as error:
        raise failure(f"listing s3://{target.bucket}/{target.base}", error) from None
    return steps, frozenset(aside)


_V = TypeVar("_V")


class EtagCache(Generic[_V]):
    """Values per (key, ETag): what an unchanged object gave once. Starts over
    when ``limit`` entries are reached (a bound, not an eviction policy)."""

    def __init__(self, limit: int) -> None:
        self._items: dict[tuple[str, str], _V] = {}
        self._limit = limit

    def get(self, key: str, etag: str) -> tuple[bool, _V | None]:
        found = (key, etag) in self._items
        return found, self._items.get((key, etag))

    def put(self, key: str, etag: str, value: _V) -> None:
        if len(self._items) >= self._limit:
            self._items.clear()
        self._items[(key, etag)] = value

    def __len__(self) -> int:
        return len(self._items)


ManifestRead = manifest_mod.Manifest | s3plan.ManifestError


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Caches:
    """One job's memory of its prefix: full-object CRC32Cs and parsed manifests."""

    heads: EtagCache[str | None] = dataclasses.field(
        default_factory=lambda: EtagCache(tunables.DEFAULT.s3.head_cache_entries)
    )
    manifests: EtagCache[ManifestRead] = dataclasses.field(
        default_factory=lambda: EtagCache(tunables.DEFAULT.s3.manifest_cache_entries)
    )


def head_crc32c(s3: S3Client, bucket: str, key: str) -> tuple[int, str | None]:
    """Size and full-object CRC32C (hex) of one object; None if the store has none."""
    head = s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    value = typing.cast(dict[str, Any], head)
    crc = s3plan.crc32c_hex_from_s3(value.get("ChecksumCRC32C"), value.get("ChecksumType"))
    return int(value.get("ContentLength", 0)), crc


def read_manifest(
    s3: S3Client,
    target: Target,
    step: int,
    *,
    max_bytes: int = tunables.DEFAULT.s3.manifest_max_bytes,
) -> ManifestRead:
    key = target.key(step, manifest_mod.MANIFEST_NAME)
    try:
        body = s3.get_object(Bucket=target.bucket, Key=key)["Body"].read(max_bytes)
    except ERRORS as error:
        raise failure(f"reading s3://{target.bucket}/{key}", error) from None
    try:
        return manifest_mod.parse_manifest(body)
    except (pydantic.ValidationError, ValueError) as error:
        first = str(error).splitlines()[0][:200]
        return s3plan.ManifestError(message=first)


def _manifest(
    s3: S3Client, target: Target, step: int, listed: Listed, cache: EtagCache[ManifestRead]
) -> ManifestRead:
    """The step's manifest; read from S3 only when its ETag is new."""
    key = target.key(step, manifest_mod.MANIFEST_NAME)
    hit, found = cache.get(key, listed.etag)
    if hit and found is not None:
        return found
    found = read_manifest(s3, target, step)
    if listed.etag:  # without an ETag a rewrite could not be told apart
        cache.put(key, listed.etag, found)
    return found


def _crc32c(
    s3: S3Client, target: Target, key: str, listed: Listed, cache: EtagCache[str | None]
) -> str | None:
    hit, crc = cache.get(key, listed.etag)
    if hit:
        return crc
    try:
        _, crc = head_crc32c(s3, target.bucket, key)
    except ERRORS as error:
        raise failure(f"head of s3://{target.bucket}/{key}", error) from None
    cache.put(key, listed.etag, crc)
    return crc


def observe(s3: S3Client, target: Target, *, caches: Caches | None = None) -> s3plan.Observation:
    """List the prefix, read each manifest, head the files each manifest lists
    (manifests and heads only for (key, ETag)s ``caches`` has not seen)."""
    listed, aside = _list(s3, target)
    caches = caches or Caches()
    listing: dict[int, dict[str, s3plan.RemoteObject]] = {}
    manifests: dict[int, ManifestRead] = {}
    for step, objects in listed.items():
        found = objects.get(manifest_mod.MANIFEST_NAME)
        if found is not None:
            manifests[step] = _manifest(s3, target, step, found, caches.manifests)
        read = manifests.get(step)
        wanted = (
            {read.data_key(entry.path) for entry in read.files}
            if isinstance(read, manifest_mod.Manifest)
            else set()
        )
        listing[step] = {}
        for path, item in objects.items():
            crc = (
                _crc32c(s3, target, target.key(step, path), item, caches.heads)
                if path in wanted
                else None
            )
            listing[step][path] = s3plan.RemoteObject(size=item.size, crc32c=crc)
    return s3plan.Observation(listing=listing, manifests=manifests, aside_steps=aside)
