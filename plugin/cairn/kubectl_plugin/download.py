"""``kubectl cairn download``: fetch one committed step from S3 and verify it.

I/O (boto3, files). The step is found through the job's
``spec.checkpoint.upload`` (bucket, prefix, endpoint, region); credentials come
from the local environment's AWS chain (``AWS_*`` variables, profiles), never
from the cluster's Secret. The remote ``manifest.json`` decides what to fetch:
its paths are validated by ``cairn.api.manifest`` (nothing can escape the
target folder), every file's size and CRC32C are checked, and the manifest is
written last, so an interrupted or failed download leaves a folder without a
manifest, which readers treat as an abandoned partial.
"""

import dataclasses
import pathlib
import sys
from collections.abc import Callable
from typing import Any, TextIO

import boto3
import botocore.exceptions
import pydantic
from awscrt import checksums

from cairn.api import checkpointspec, manifest
from cairn.kubectl_plugin import kube, views

CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Source:
    bucket: str
    key_prefix: str
    """``<prefix>/step-<N>`` without a trailing slash."""
    endpoint: str | None
    region: str | None


def source(job: dict[str, Any], *, step: int, endpoint: str | None) -> Source:
    """Where ``step`` of ``job`` lives (pure)."""
    upload = ((job.get("spec") or {}).get("checkpoint") or {}).get("upload")
    if not upload:
        raise kube.PluginError("the job has no spec.checkpoint.upload: nothing to download")
    bucket, prefix = checkpointspec.split_s3_uri(str(upload["uri"]))
    name = manifest.step_dir_name(step)
    return Source(
        bucket=bucket,
        key_prefix=f"{prefix}/{name}" if prefix else name,
        endpoint=endpoint or upload.get("endpoint"),
        region=upload.get("region"),
    )


class _Progress:
    """A one-line progress bar on a terminal; one summary line otherwise."""

    def __init__(self, *, total: int, files: int, stream: TextIO) -> None:
        self.total = total
        self.files = files
        self.done = 0
        self.files_done = 0
        self.stream = stream
        self.live = stream.isatty()

    def add(self, count: int) -> None:
        self.done += count
        if self.live:
            self.stream.write("\r" + views.progress_line(self._state()))
            self.stream.flush()

    def file_done(self) -> None:
        self.files_done += 1
        self.add(0)

    def finish(self) -> None:
        self.stream.write(("\r" if self.live else "") + views.progress_line(self._state()) + "\n")
        self.stream.flush()

    def _state(self) -> views.Progress:
        return views.Progress(
            done=self.done, total=self.total, files_done=self.files_done, files=self.files
        )


def _crc32c(path: pathlib.Path) -> str:
    crc = 0
    with path.open("rb") as stream:
        while chunk := stream.read(CHUNK):
            crc = checksums.crc32c(chunk, crc)
    return f"{crc:08x}"


def fetch(
    *,
    src: Source,
    target: pathlib.Path,
    progress_stream: TextIO | None = None,
    client_factory: Callable[..., Any] = boto3.client,
) -> manifest.Manifest:
    """Download and verify one step into ``target`` (created; must not hold a manifest).

    Progress goes to ``progress_stream`` (default: ``sys.stderr`` at call time).
    """
    s3 = client_factory("s3", endpoint_url=src.endpoint, region_name=src.region)
    try:
        raw = s3.get_object(Bucket=src.bucket, Key=f"{src.key_prefix}/{manifest.MANIFEST_NAME}")
        data = raw["Body"].read()
    except botocore.exceptions.ClientError as error:
        code = error.response.get("Error", {}).get("Code", "")
        if code in ("NoSuchKey", "404"):
            raise kube.PluginError(
                f"s3://{src.bucket}/{src.key_prefix}/ has no manifest: the step is not committed remotely"
            ) from error
        raise kube.PluginError(f"reading the manifest: {error}") from error
    try:
        parsed = manifest.parse_manifest(data)
    except (
        pydantic.ValidationError,
        manifest.UnsafePathError,
        manifest.UnsupportedManifestVersionError,
    ) as error:
        raise kube.PluginError(f"the remote manifest is invalid: {error}") from error
    if (target / manifest.MANIFEST_NAME).exists():
        raise kube.PluginError(f"{target} already holds a committed step; choose another --to")
    target.mkdir(parents=True, exist_ok=True)
    bar = _Progress(
        total=parsed.total_bytes, files=len(parsed.files), stream=progress_stream or sys.stderr
    )
    for entry in parsed.files:
        path = target / entry.path
        path.parent.mkdir(parents=True, exist_ok=True)
        # Attempt-scoped data keys (`data_prefix`), or flat for an older Cairn.
        key = f"{src.key_prefix}/{parsed.data_key(entry.path)}"
        try:
            s3.download_file(src.bucket, key, str(path), Callback=bar.add)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as error:
            raise kube.PluginError(f"downloading s3://{src.bucket}/{key}: {error}") from error
        size = path.stat().st_size
        if size != entry.size:
            raise kube.PluginError(f"{entry.path}: {size} bytes, the manifest says {entry.size}")
        crc = _crc32c(path)
        if crc != entry.crc32c:
            raise kube.PluginError(f"{entry.path}: CRC32C {crc}, the manifest says {entry.crc32c}")
        bar.file_done()
    bar.finish()
    (target / manifest.MANIFEST_NAME).write_bytes(data)
    return parsed
