"""The S3 tier: per-rank parallel upload, conditional manifest, verified download.

Each rank uploads the files it wrote with s3transfer (multipart, parts in
parallel, files in parallel, native CRC32C checksums that the server checks
per part). Botocore's standard retry mode retries 5xx, SlowDown and
connection resets a bounded number of times; a socket read timeout bounds a
silent request and `transfer_timeout` bounds a whole transfer. The manifest
is written with `If-None-Match: *` so a remote commit never overwrites an
existing one; stores that reject conditional writes fall back to
check-then-put. Remote commit = the manifest object exists.
"""

from __future__ import annotations

import base64
import logging
import pathlib
import time
import typing

import boto3
import boto3.s3.transfer
import botocore.config
import botocore.exceptions
import pydantic
from awscrt import checksums

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import errors, layout, options

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

log = logging.getLogger(__name__)


def make_client(opts: options.S3Options) -> S3Client:
    """An S3 client with bounded retries and timeouts."""
    config = botocore.config.Config(
        region_name=opts.region,
        connect_timeout=opts.connect_timeout,
        read_timeout=opts.read_timeout,
        retries={"max_attempts": opts.max_attempts, "mode": "standard"},
        max_pool_connections=max(10, opts.concurrency * 2),
        # Checksums only where an operation needs one; we ask for CRC32C
        # explicitly on uploads (and some S3-compatible stores reject the
        # unsigned trailing checksums the default turns on).
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": "path"},
    )
    session = boto3.session.Session(
        aws_access_key_id=opts.access_key, aws_secret_access_key=opts.secret_key
    )
    client: S3Client = session.client("s3", endpoint_url=opts.endpoint_url, config=config)
    return client


def step_prefix(opts: options.S3Options, step: int) -> str:
    name = manifest_mod.step_dir_name(step)
    return f"{opts.prefix}/{name}" if opts.prefix else name


def _transfer_config(opts: options.S3Options) -> boto3.s3.transfer.TransferConfig:
    return boto3.s3.transfer.TransferConfig(
        multipart_threshold=opts.part_size,
        multipart_chunksize=opts.part_size,
        max_concurrency=opts.concurrency,
        use_threads=True,
        # The classic s3transfer client honours botocore retries and event
        # hooks; the CRT client would bypass both.
        preferred_transfer_client="classic",
    )


def _abort(manager: typing.Any, futures: list[typing.Any]) -> None:
    # Cancel each transfer, then wait for the workers: an in-flight request
    # ends within read_timeout x max_attempts. (TransferManager.shutdown's
    # own cancel argument is broken in s3transfer 0.19: it passes its
    # arguments in the wrong order.)
    for future in futures:
        future.cancel()
    manager.shutdown()


def _poll_result(future: typing.Any, deadline: float) -> None:
    while not future.done():
        if time.monotonic() > deadline:
            raise TimeoutError
        time.sleep(0.05)
    future.result()


def upload_files(
    client: S3Client,
    opts: options.S3Options,
    *,
    step: int,
    folder: pathlib.Path,
    names: list[str],
) -> int:
    """Upload `names` from `folder` under the step prefix; returns bytes sent."""
    deadline = time.monotonic() + opts.transfer_timeout
    prefix = step_prefix(opts, step)
    manager = boto3.s3.transfer.create_transfer_manager(client, _transfer_config(opts))
    sent = 0
    futures: list[typing.Any] = []
    try:
        for name in names:
            path = folder / name
            sent += path.stat().st_size
            futures.append(
                manager.upload(
                    str(path),
                    opts.bucket,
                    f"{prefix}/{name}",
                    extra_args={"ChecksumAlgorithm": "CRC32C"},
                )
            )
        for future in futures:
            _poll_result(future, deadline)
    except TimeoutError as exc:
        _abort(manager, futures)
        raise errors.RemoteError(
            f"upload of step {step} did not finish within {opts.transfer_timeout:.0f}s "
            f"(endpoint {opts.endpoint_url or 'AWS'})"
        ) from exc
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
        _abort(manager, futures)
        raise errors.RemoteError(
            f"upload of step {step} to {opts.endpoint_url or 'AWS'} failed: {exc}"
        ) from exc
    manager.shutdown()
    return sent


def put_manifest(
    client: S3Client, opts: options.S3Options, manifest: manifest_mod.Manifest
) -> None:
    """The remote commit: create the manifest object if absent.

    An existing identical manifest (a retried request that had succeeded) is
    success; a different one is refused (FencedError).
    """
    body = manifest_mod.dump_manifest(manifest)
    key = f"{step_prefix(opts, manifest.step)}/{manifest_mod.MANIFEST_NAME}"
    crc = base64.b64encode(checksums.crc32c(body).to_bytes(4, "big")).decode()
    try:
        client.put_object(
            Bucket=opts.bucket, Key=key, Body=body, IfNoneMatch="*", ChecksumCRC32C=crc
        )
        return
    except botocore.exceptions.ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
            existing = _get_bytes(client, opts.bucket, key)
            if existing == body:
                return
            raise errors.FencedError(f"s3://{opts.bucket}/{key} exists with other content") from exc
        if status not in (400, 501) and code not in ("NotImplemented", "InvalidArgument"):
            raise errors.RemoteError(f"manifest upload to {key} failed: {exc}") from exc
        log.warning("store rejected If-None-Match (%s); falling back to check-then-put", code)
    except botocore.exceptions.BotoCoreError as exc:
        raise errors.RemoteError(f"manifest upload to {key} failed: {exc}") from exc
    # Fallback for stores without conditional writes: not atomic, but fencing
    # already refused older attempts before we got here.
    if _exists(client, opts.bucket, key):
        if _get_bytes(client, opts.bucket, key) == body:
            return
        raise errors.FencedError(f"s3://{opts.bucket}/{key} exists with other content")
    try:
        client.put_object(Bucket=opts.bucket, Key=key, Body=body, ChecksumCRC32C=crc)
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
        raise errors.RemoteError(f"manifest upload to {key} failed: {exc}") from exc


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


def committed_steps(client: S3Client, opts: options.S3Options) -> list[int]:
    """Steps whose manifest object exists (remote commit), oldest first."""
    base = f"{opts.prefix}/" if opts.prefix else ""
    steps: list[int] = []
    try:
        paginator = client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=opts.bucket, Prefix=base):
            for obj in page.get("Contents", []):
                rest = obj["Key"][len(base) :]
                folder, _, name = rest.partition("/")
                step = manifest_mod.parse_step_dir_name(folder)
                if step is not None and name == manifest_mod.MANIFEST_NAME:
                    steps.append(step)
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
        raise errors.RemoteError(f"listing s3://{opts.bucket}/{base} failed: {exc}") from exc
    return sorted(steps)


def get_manifest(client: S3Client, opts: options.S3Options, step: int) -> manifest_mod.Manifest:
    key = f"{step_prefix(opts, step)}/{manifest_mod.MANIFEST_NAME}"
    try:
        return manifest_mod.parse_manifest(_get_bytes(client, opts.bucket, key))
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
        raise errors.RemoteError(f"reading s3://{opts.bucket}/{key} failed: {exc}") from exc
    except (pydantic.ValidationError, ValueError) as exc:
        raise errors.CheckpointError(
            f"s3://{opts.bucket}/{key} is not a valid manifest: {exc}"
        ) from exc


def download_files(
    client: S3Client,
    opts: options.S3Options,
    *,
    step: int,
    folder: pathlib.Path,
    entries: tuple[manifest_mod.FileEntry, ...],
) -> int:
    """Download manifest entries into folder (parallel ranged GETs); returns bytes.

    Every path is checked before anything is written (no `..`, no absolute
    path, no symlink on the way), so a hostile manifest cannot write outside
    the step folder.
    """
    targets = [(entry, layout.safe_target(folder, entry.path)) for entry in entries]
    deadline = time.monotonic() + opts.transfer_timeout
    prefix = step_prefix(opts, step)
    manager = boto3.s3.transfer.create_transfer_manager(client, _transfer_config(opts))
    received = 0
    futures: list[typing.Any] = []
    try:
        for entry, target in targets:
            target.parent.mkdir(parents=True, exist_ok=True)
            received += entry.size
            futures.append(manager.download(opts.bucket, f"{prefix}/{entry.path}", str(target)))
        for future in futures:
            _poll_result(future, deadline)
    except TimeoutError as exc:
        _abort(manager, futures)
        raise errors.RemoteError(f"download of step {step} did not finish in time") from exc
    except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as exc:
        _abort(manager, futures)
        raise errors.RemoteError(f"download of step {step} failed: {exc}") from exc
    manager.shutdown()
    return received
