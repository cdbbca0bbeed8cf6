"""The operator's S3 edge: client from the job's upload spec, list, head, read, delete.

Blocking (boto3 and the Kubernetes client): call from a worker thread. The
decisions are in ``remoteplan`` (pure); this module only observes and
deletes. Layout (the writer's, ``cairn.checkpoint.remote``):
``s3://bucket/<prefix>/step-<N, 9 digits>/<files>`` with ``manifest.json``
written last.

Credentials: the Secret named by ``upload.credentialsSecretRef`` in the job's
namespace is read at call time (RBAC: ``get`` on secrets, nothing else) and
its values go only into the boto3 session; they are never logged, put in an
event or stored. Without a reference, boto3's default chain applies (e.g.
workload identity). Retries: botocore standard mode with a bounded number of
attempts and socket timeouts, so one call is bounded in time.
"""

from __future__ import annotations

import base64
import dataclasses
import typing
from collections.abc import Iterable
from typing import Any

import boto3
import botocore.config
import botocore.exceptions
import pydantic
from kubernetes import client as k8s
from kubernetes.client import exceptions as k8s_exceptions

from cairn.api import checkpointspec, retention
from cairn.api import manifest as manifest_mod
from cairn.operator import remoteplan, tunables

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client


class StoreError(Exception):
    """Reading or changing the prefix failed; the message carries no secrets."""


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


def credentials(
    api: Any, namespace: str, ref: checkpointspec.SecretRef | None, *, job_uid: str = ""
) -> tuple[str | None, str | None]:
    """The access key pair from the referenced Secret (read now), or (None, None).

    With ``job_uid``, a pair read before is remembered in process memory and
    used when the Secret is gone (404).
    """
    if ref is None:
        return None, None
    try:
        secret = k8s.CoreV1Api(api).read_namespaced_secret(ref.name, namespace)
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
    """An S3 client for the job's store, with bounded retries and timeouts."""
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


def client_for(
    api: Any, namespace: str, upload: checkpointspec.UploadSpec, *, job_uid: str = ""
) -> S3Client:
    access, secret = credentials(api, namespace, upload.credentials_secret_ref, job_uid=job_uid)
    return make_client(upload, access_key=access, secret_key=secret)


def _fail(what: str, error: Exception) -> StoreError:
    if isinstance(error, botocore.exceptions.ClientError):
        code = error.response.get("Error", {}).get("Code", "?")
        return StoreError(f"{what} failed: {code}")
    return StoreError(f"{what} failed: {type(error).__name__}: {error}")


_ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)


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
    except _ERRORS as error:
        raise _fail(f"listing s3://{target.bucket}/{target.base}", error) from None
    return steps, frozenset(aside)


class HeadCache:
    """Full-object CRC32C per (key, ETag): an unchanged object is headed once."""

    def __init__(self, limit: int = tunables.DEFAULT.s3.head_cache_entries) -> None:
        self._items: dict[tuple[str, str], str | None] = {}
        self._limit = limit

    def get(self, key: str, etag: str) -> tuple[bool, str | None]:
        found = (key, etag) in self._items
        return found, self._items.get((key, etag))

    def put(self, key: str, etag: str, value: str | None) -> None:
        if len(self._items) >= self._limit:
            self._items.clear()
        self._items[(key, etag)] = value


def head_crc32c(s3: S3Client, bucket: str, key: str) -> tuple[int, str | None]:
    """Size and full-object CRC32C (hex) of one object; None if the store has none."""
    head = s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    value = typing.cast(dict[str, Any], head)
    crc = remoteplan.crc32c_hex_from_s3(value.get("ChecksumCRC32C"), value.get("ChecksumType"))
    return int(value.get("ContentLength", 0)), crc


def read_manifest(
    s3: S3Client,
    target: Target,
    step: int,
    *,
    max_bytes: int = tunables.DEFAULT.s3.manifest_max_bytes,
) -> manifest_mod.Manifest | remoteplan.ManifestError:
    key = target.key(step, manifest_mod.MANIFEST_NAME)
    try:
        body = s3.get_object(Bucket=target.bucket, Key=key)["Body"].read(max_bytes)
    except _ERRORS as error:
        raise _fail(f"reading s3://{target.bucket}/{key}", error) from None
    try:
        return manifest_mod.parse_manifest(body)
    except (pydantic.ValidationError, ValueError) as error:
        first = str(error).splitlines()[0][:200]
        return remoteplan.ManifestError(message=first)


def observe(
    s3: S3Client, target: Target, *, cache: HeadCache | None = None
) -> remoteplan.Observation:
    """List the prefix, read each manifest, head the files each manifest lists."""
    listed, aside = _list(s3, target)
    cache = cache or HeadCache()
    listing: dict[int, dict[str, remoteplan.RemoteObject]] = {}
    manifests: dict[int, manifest_mod.Manifest | remoteplan.ManifestError] = {}
    for step, objects in listed.items():
        if manifest_mod.MANIFEST_NAME in objects:
            manifests[step] = read_manifest(s3, target, step)
        wanted = (
            {found.data_key(entry.path) for entry in found.files}
            if isinstance(found := manifests.get(step), manifest_mod.Manifest)
            else set()
        )
        listing[step] = {}
        for path, item in objects.items():
            crc: str | None = None
            if path in wanted:
                key = target.key(step, path)
                hit, crc = cache.get(key, item.etag)
                if not hit:
                    try:
                        _, crc = head_crc32c(s3, target.bucket, key)
                    except _ERRORS as error:
                        raise _fail(f"head of s3://{target.bucket}/{key}", error) from None
                    cache.put(key, item.etag, crc)
            listing[step][path] = remoteplan.RemoteObject(size=item.size, crc32c=crc)
    return remoteplan.Observation(listing=listing, manifests=manifests, aside_steps=aside)


def _delete_batch(
    s3: S3Client, bucket: str, keys: list[str], *, batch: int = tunables.DEFAULT.s3.delete_batch
) -> None:
    for start in range(0, len(keys), batch):
        chunk = keys[start : start + batch]
        try:
            answer = s3.delete_objects(
                Bucket=bucket,
                Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True},
            )
        except _ERRORS as error:
            raise _fail(f"deleting {len(chunk)} objects in s3://{bucket}", error) from None
        failed = answer.get("Errors", [])
        if failed:
            first = failed[0]
            raise StoreError(
                f"deleting s3://{bucket}/{first.get('Key', '?')} failed: {first.get('Code', '?')}"
                f" ({len(failed)} objects not deleted)"
            )


def delete_keys(s3: S3Client, bucket: str, keys: Iterable[str]) -> int:
    """Delete keys: every ``manifest.json`` first, one by one, then the rest in batches
    (``retention.split_manifests``: an interruption leaves at worst an abandoned
    partial). The operator's only deletion in S3."""
    manifests, rest = retention.split_manifests(list(keys))
    for key in manifests:
        try:
            s3.delete_object(Bucket=bucket, Key=key)
        except _ERRORS as error:
            raise _fail(f"deleting s3://{bucket}/{key}", error) from None
    _delete_batch(s3, bucket, rest)
    return len(manifests) + len(rest)


def delete_steps(
    s3: S3Client, target: Target, deletions: Iterable[remoteplan.StepDeletion]
) -> tuple[int, ...]:
    """Apply a plan's deletions step by step (manifest first); the steps deleted."""
    done: list[int] = []
    for deletion in deletions:
        delete_keys(s3, target.bucket, [target.key(deletion.step, p) for p in deletion.paths])
        done.append(deletion.step)
    return tuple(done)


def delete_prefix(s3: S3Client, target: Target) -> int:
    """Delete every step folder under the job's prefix (manifests first); the count.

    Only the writer's layout (``step-<N>/...``) is deleted: an object of
    another name under the prefix was not written by Cairn and stays.
    """
    steps = list_steps(s3, target)
    keys = [target.key(step, path) for step, objects in steps.items() for path in objects]
    return delete_keys(s3, target.bucket, keys)
