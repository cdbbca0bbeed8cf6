"""The S3 tier's object operations: per-rank parallel upload, conditional
manifest, listing, verified download, the prefix-owner check.

Each rank uploads the files it wrote with s3transfer (multipart, parts in
parallel, files in parallel, native CRC32C checksums that the server checks
per part); `transfer_timeout` bounds a whole transfer, and the transport
underneath (`cairn.checkpoint.s3transport`: the client, the progress
watchdog, bounded small requests, `is_transient`/`retrying`) catches a hung
store in seconds and names the endpoint. The manifest is written with
`If-None-Match: *` so a remote commit never overwrites an existing one;
stores that reject conditional writes fall back to check-then-put. Remote
commit = the manifest object exists.

The read side (restore, import) reports a missing object or a refusal as
such, never as a verdict on the data; transient failures propagate for
`s3transport.retrying` to bound.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import pathlib
import time
import typing

import boto3.s3.transfer
import botocore.exceptions
from awscrt import checksums

from cairn.api import manifest as manifest_mod
from cairn.api import s3owner
from cairn.checkpoint import errors, layout, options, s3transport

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import ObjectTypeDef

log = logging.getLogger(__name__)


def step_prefix(opts: options.S3Options, step: int) -> str:
    name = manifest_mod.step_dir_name(step)
    return f"{opts.prefix}/{name}" if opts.prefix else name


def crc32c_base64(crc32c_hex: str) -> str:
    """A manifest's 8-hex-digit CRC32C as S3's base64 `ChecksumCRC32C`. Pure."""
    return base64.b64encode(bytes.fromhex(crc32c_hex)).decode()


def upload_files(
    client: S3Client,
    opts: options.S3Options,
    *,
    folder: pathlib.Path,
    manifest: manifest_mod.Manifest,
    entries: typing.Sequence[manifest_mod.FileEntry],
) -> int:
    """Upload manifest `entries` from `folder` to their data keys; returns bytes sent.

    Keys are `step-<N>/<data_prefix>/<path>` (attempt-scoped: an upload of
    one attempt never overwrites another attempt's objects). Each object
    carries the manifest's whole-file CRC32C (`ChecksumCRC32C`; multipart
    uploads as `ChecksumType=FULL_OBJECT`): the server refuses bytes that do
    not match what was committed, and reports the same CRC on HEAD.
    """
    deadline = time.monotonic() + opts.transfer_timeout
    prefix = data_prefix(step_prefix(opts, manifest.step), manifest)
    step = manifest.step
    manager = boto3.s3.transfer.create_transfer_manager(client, s3transport.transfer_config(opts))
    watchdog = s3transport.Watchdog()
    sent = 0
    futures: list[typing.Any] = []
    try:
        for entry in entries:
            path = layout.safe_target(folder, entry.path)
            sent += path.stat().st_size
            futures.append(
                manager.upload(
                    str(path),
                    opts.bucket,
                    f"{prefix}/{entry.path}",
                    extra_args={"ChecksumCRC32C": crc32c_base64(entry.crc32c)},
                    subscribers=[watchdog],
                )
            )
        for future in futures:
            s3transport.poll_result(future, deadline=deadline, watchdog=watchdog, opts=opts)
    except s3transport.StallError as exc:
        s3transport.abort(manager, futures)
        raise errors.RemoteError(f"upload of step {step}: {exc}") from exc
    except TimeoutError as exc:
        s3transport.abort(manager, futures)
        raise errors.RemoteError(
            f"upload of step {step} did not finish within {opts.transfer_timeout:.0f}s "
            f"(endpoint {opts.endpoint_url or 'AWS'})"
        ) from exc
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
        s3transport.abort(manager, futures)
        raise errors.RemoteError(
            f"upload of step {step} to {opts.endpoint_url or 'AWS'} failed: {exc}"
        ) from exc
    manager.shutdown()
    return sent


class ForeignManifestError(errors.FencedError):
    """The manifest key holds another job's manifest."""

    def __init__(self, message: str, *, owner: str) -> None:
        super().__init__(message)
        self.owner = owner


def put_manifest(
    client: S3Client, opts: options.S3Options, manifest: manifest_mod.Manifest
) -> None:
    """The remote commit: create the manifest object if absent.

    An existing identical manifest (a retried request that had succeeded) is
    success; another job's manifest in the way (a re-created job writing to
    the old prefix) raises ForeignManifestError (the caller moves it aside
    and retries); any other existing manifest is refused (FencedError).
    """
    body = manifest_mod.dump_manifest(manifest)
    key = f"{step_prefix(opts, manifest.step)}/{manifest_mod.MANIFEST_NAME}"
    crc = base64.b64encode(checksums.crc32c(body).to_bytes(4, "big")).decode()
    try:
        s3transport.bounded(
            lambda: client.put_object(
                Bucket=opts.bucket, Key=key, Body=body, IfNoneMatch="*", ChecksumCRC32C=crc
            ),
            seconds=opts.stall_seconds,
            what=f"manifest upload to {opts.endpoint_url or 'AWS S3'}",
        )
        return
    except s3transport.StallError as exc:
        raise errors.RemoteError(
            f"manifest upload to {key} failed: {s3transport.stall_message(opts)}"
        ) from exc
    except botocore.exceptions.ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
            existing = _get_bytes(client, opts.bucket, key)
            if existing == body:
                return
            _refuse_existing(opts, key, existing, manifest)
        if status not in (400, 501) and code not in ("NotImplemented", "InvalidArgument"):
            raise errors.RemoteError(f"manifest upload to {key} failed: {exc}") from exc
        log.warning("store rejected If-None-Match (%s); falling back to check-then-put", code)
    except botocore.exceptions.BotoCoreError as exc:
        raise errors.RemoteError(f"manifest upload to {key} failed: {exc}") from exc
    # Fallback for stores without conditional writes: not atomic, but fencing
    # already refused older attempts before we got here.
    if _exists(client, opts.bucket, key):
        existing = _get_bytes(client, opts.bucket, key)
        if existing == body:
            return
        _refuse_existing(opts, key, existing, manifest)
    try:
        client.put_object(Bucket=opts.bucket, Key=key, Body=body, ChecksumCRC32C=crc)
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
        raise errors.RemoteError(f"manifest upload to {key} failed: {exc}") from exc


def _refuse_existing(
    opts: options.S3Options, key: str, existing: bytes, manifest: manifest_mod.Manifest
) -> typing.NoReturn:
    """Raise for a manifest key that holds other content: foreign or ours."""
    owner: str | None = None
    # Unreadable (newer version, garbage): never replaced.
    with contextlib.suppress(ValueError):
        owner = manifest_mod.parse_manifest(existing).job_uid
    if owner is not None and not layout.owns(owner, job_uid=manifest.job_uid):
        raise ForeignManifestError(
            f"s3://{opts.bucket}/{key} is job {owner}'s manifest", owner=owner
        )
    raise errors.FencedError(f"s3://{opts.bucket}/{key} exists with other content")


def _get_bytes(client: S3Client, bucket: str, key: str) -> bytes:
    return client.get_object(Bucket=bucket, Key=key)["Body"].read()


def _exists(client: S3Client, bucket: str, key: str) -> bool:
    try:
        client.head_object(Bucket=bucket, Key=key)
    except botocore.exceptions.ClientError as exc:
        if exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
            return False
        raise
    return True


def _listed(
    client: S3Client, bucket: str, base: str, *, within: float | None
) -> typing.Iterator[ObjectTypeDef]:
    """The objects under `base`, page by page; each page's request bounded by
    `within` seconds (StallError): a hung store fails a listing in seconds,
    while a long listing that keeps answering is never cut."""
    pages = iter(client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base))
    sentinel: dict[str, typing.Any] = {}
    while True:
        if within is None:
            page = next(pages, sentinel)
        else:
            page = s3transport.bounded(
                lambda: next(pages, sentinel), seconds=within, what=f"listing s3://{bucket}/{base}"
            )
        if page is sentinel:
            return
        yield from page.get("Contents", [])


def committed_steps(client: S3Client, opts: options.S3Options) -> list[int]:
    """Steps whose manifest object exists (remote commit), oldest first.

    Each page of the listing waits at most `opts.stall_seconds` for its
    answer; a hung or failing store is a TransportError saying so."""
    base = f"{opts.prefix}/" if opts.prefix else ""
    steps: list[int] = []
    try:
        for obj in _listed(client, opts.bucket, base, within=opts.stall_seconds):
            rest = obj["Key"][len(base) :]
            folder, _, name = rest.partition("/")
            step = manifest_mod.parse_step_dir_name(folder)
            if step is not None and name == manifest_mod.MANIFEST_NAME:
                steps.append(step)
    except (
        botocore.exceptions.BotoCoreError,
        botocore.exceptions.ClientError,
        s3transport.StallError,
    ) as exc:
        kind = errors.TransportError if s3transport.is_transient(exc) else errors.RemoteError
        raise kind(f"listing s3://{opts.bucket}/{base} failed: {exc}") from exc
    return sorted(steps)


def get_bytes_or_none(
    client: S3Client, bucket: str, key: str, *, within: float | None = None
) -> bytes | None:
    """An object's bytes, or None when it does not exist (404).

    Transient failures propagate as botocore errors (for `retrying`), an
    answer missing after `within` seconds as StallError (transient); other
    refusals become RemoteError.
    """
    try:
        if within is None:
            return _get_bytes(client, bucket, key)
        return s3transport.bounded(
            lambda: _get_bytes(client, bucket, key), seconds=within, what=f"reading {key}"
        )
    except botocore.exceptions.ClientError as exc:
        if s3transport.is_not_found(exc):
            return None
        if s3transport.is_transient(exc):
            raise
        raise errors.RemoteError(f"reading s3://{bucket}/{key} failed: {exc}") from exc


def list_sizes(
    client: S3Client, bucket: str, prefix: str, *, within: float | None = None
) -> dict[str, int]:
    """Sizes of the objects under `prefix/`, by key relative to it; each page
    waits at most `within` seconds (StallError, transient: wrap in `retrying`)."""
    base = f"{prefix}/" if prefix else ""
    found: dict[str, int] = {}
    try:
        for obj in _listed(client, bucket, base, within=within):
            found[obj["Key"][len(base) :]] = int(obj["Size"])
    except botocore.exceptions.ClientError as exc:
        if s3transport.is_transient(exc):
            raise
        raise errors.RemoteError(f"listing s3://{bucket}/{base} failed: {exc}") from exc
    return found


def data_prefix(folder_prefix: str, manifest: manifest_mod.Manifest) -> str:
    """Key prefix of a step's data objects: `<folder>/<data_prefix>` as the
    manifest records it, or the folder itself for an older Cairn. Pure."""
    if manifest.data_prefix:
        return f"{folder_prefix}/{manifest.data_prefix}"
    return folder_prefix


class MissingObjectError(errors.RemoteError):
    """An object the manifest lists does not exist: the copy is incomplete (not corrupt)."""


def download_files(
    client: S3Client,
    opts: options.S3Options,
    *,
    bucket: str,
    prefix: str,
    folder: pathlib.Path,
    names: typing.Sequence[str],
) -> int:
    """Download `prefix/<name>` to `folder/<name>` (parallel ranged GETs); returns bytes.

    Every path is checked before anything is written (no `..`, no absolute
    path, no symlink on the way), so a hostile manifest cannot write outside
    the step folder. Transient failures propagate as botocore/s3transfer
    errors (wrap in `retrying`); a missing object is MissingObjectError;
    other refusals are RemoteError. Sizes and CRCs are the caller's to check.
    """
    targets = [(name, layout.safe_target(folder, name)) for name in names]
    deadline = time.monotonic() + opts.transfer_timeout
    manager = boto3.s3.transfer.create_transfer_manager(client, s3transport.transfer_config(opts))
    watchdog = s3transport.Watchdog()
    futures: list[typing.Any] = []
    try:
        for name, target in targets:
            target.parent.mkdir(parents=True, exist_ok=True)
            futures.append(
                manager.download(bucket, f"{prefix}/{name}", str(target), subscribers=[watchdog])
            )
        for future in futures:
            s3transport.poll_result(future, deadline=deadline, watchdog=watchdog, opts=opts)
    except s3transport.StallError as exc:
        s3transport.abort(manager, futures)
        raise s3transport.StallError(f"download from s3://{bucket}/{prefix}: {exc}") from exc
    except TimeoutError as exc:
        s3transport.abort(manager, futures)
        raise TimeoutError(
            f"download from s3://{bucket}/{prefix} did not finish in {opts.transfer_timeout:.0f}s"
        ) from exc
    except botocore.exceptions.ClientError as exc:
        s3transport.abort(manager, futures)
        if s3transport.is_not_found(exc):
            raise MissingObjectError(f"s3://{bucket}/{prefix}: a listed object is missing") from exc
        if s3transport.is_transient(exc):
            raise
        raise errors.RemoteError(f"download from s3://{bucket}/{prefix} failed: {exc}") from exc
    except BaseException:
        s3transport.abort(manager, futures)
        raise
    manager.shutdown()
    return sum(target.stat().st_size for _, target in targets)


def check_prefix_owner(
    client: S3Client,
    opts: options.S3Options,
    *,
    job_uid: str,
    claim_as: s3owner.Owner | None = None,
) -> None:
    """Refuse to upload under a prefix another job owns (`cairn.api.s3owner`).

    Raises ConfigurationError when `<prefix>/.cairn/owner.json` names another
    job or cannot be read: every save would land among that job's
    checkpoints, and a restart cannot fix it. An absent owner object is
    claimed for `claim_as` (this job: the operator's record format, created
    with `If-None-Match: *`, so the operator and the writer racing both win
    with the same record and another job never does) before the first
    upload, when the operator has not claimed it yet (its first pass comes
    seconds after the job, or never when it may not call the store). An
    unreachable store, or one without conditional writes, is logged and left
    to the operator's claim, so an outage never stops a start. A prefix inside
    another job's (an owner object at an outer level) is a configuration
    error too: that job's retention and onDelete would reach these uploads.
    """
    if not _refuse_outer_owners(client, opts, job_uid=job_uid):
        return  # unreachable (logged): one bounded read, not one per level
    base = f"{opts.prefix}/" if opts.prefix else ""
    key = f"{base}{s3owner.OWNER_KEY}"
    for _ in range(2):
        try:
            body = _owner_bytes(client, opts, key)
        except errors.RemoteError as exc:
            log.warning("could not read the prefix owner s3://%s/%s: %s", opts.bucket, key, exc)
            return
        if body is not None:
            _judge_owner(opts, key, body, job_uid=job_uid)
            return
        if claim_as is None or _claim_settled(client, opts, key, claim_as):
            return
    log.warning("owner s3://%s/%s appeared and vanished; left to the operator", opts.bucket, key)


def _owner_bytes(client: S3Client, opts: options.S3Options, key: str) -> bytes | None:
    """An owner object's bytes, None when absent; RemoteError when unreachable."""
    return s3transport.retrying(
        lambda: get_bytes_or_none(client, opts.bucket, key, within=opts.stall_seconds),
        what=f"reading {key}",
    )


def _refuse_outer_owners(client: S3Client, opts: options.S3Options, *, job_uid: str) -> bool:
    """ConfigurationError when an outer level of the prefix (the bucket root
    included) holds another job's, or an unreadable, owner object; False
    (logged) when the store did not answer."""
    parts = opts.prefix.split("/") if opts.prefix else []
    for depth in range(len(parts)):
        outer = "".join(f"{part}/" for part in parts[:depth])
        key = f"{outer}{s3owner.OWNER_KEY}"
        try:
            body = _owner_bytes(client, opts, key)
        except errors.RemoteError as exc:
            log.warning("could not read the prefix owner s3://%s/%s: %s", opts.bucket, key, exc)
            return False
        owner = s3owner.parse_owner(body) if body is not None else None
        if owner is None or (isinstance(owner, s3owner.Owner) and owner.uid == job_uid):
            continue
        whose = owner.describe() if isinstance(owner, s3owner.Owner) else "(unreadable owner)"
        raise errors.ConfigurationError(
            f"checkpoint.upload.uri {opts.uri} is inside s3://{opts.bucket}/{outer}, the "
            f"prefix of TrainingJob {whose}: its retention and onDelete would reach this "
            "job's checkpoints; choose a prefix beside it"
        )
    return True


def _claim_settled(client: S3Client, opts: options.S3Options, key: str, me: s3owner.Owner) -> bool:
    """Create the owner object. True: claimed, or left to the operator (the store
    failed or rejects conditional writes); False: another writer was first."""
    try:
        s3transport.bounded(
            lambda: client.put_object(
                Bucket=opts.bucket, Key=key, Body=me.to_json(), IfNoneMatch="*"
            ),
            seconds=opts.stall_seconds,
            what=f"claiming {key}",
        )
        log.info("claimed the upload prefix: s3://%s/%s", opts.bucket, key)
        return True
    except botocore.exceptions.ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
            return False
        log.warning("could not claim s3://%s/%s (%s); left to the operator", opts.bucket, key, code)
    except (s3transport.StallError, botocore.exceptions.BotoCoreError) as exc:
        log.warning("could not claim s3://%s/%s: %s; left to the operator", opts.bucket, key, exc)
    return True


def _judge_owner(opts: options.S3Options, key: str, body: bytes, *, job_uid: str) -> None:
    """ConfigurationError unless the owner object names this job."""
    owner = s3owner.parse_owner(body)
    if isinstance(owner, s3owner.Unreadable):
        raise errors.ConfigurationError(
            f"checkpoint.upload.uri {opts.uri}: its owner object {key} cannot be read "
            f"({owner.why}); choose another prefix"
        )
    if owner.uid != job_uid:
        raise errors.ConfigurationError(
            f"checkpoint.upload.uri {opts.uri} belongs to TrainingJob {owner.describe()}; "
            "a job never writes under another job's prefix: choose another upload.uri "
            "(resume.uri may still read from it)"
        )
