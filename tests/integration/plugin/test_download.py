"""``kubectl cairn download`` against the devcluster's real S3 (SeaweedFS).

Covers: a committed step (manifest + files of two ranks, one in a sub-folder)
is fetched through the job's ``spec.checkpoint.upload``, every file's size and
CRC32C verified, the manifest written last, a one-line progress summary when
stderr is not a terminal; ``--endpoint`` overriding the job's pod-side
endpoint; a corrupted file is refused and leaves no manifest; a step without a
remote manifest is "not committed"; a target that already holds a step is
refused; a job without upload.
"""

import dataclasses
import io
import pathlib
import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from awscrt import checksums

from cairn.api import manifest
from cairn.kubectl_plugin import cli
from tests.conftest import DevclusterHandle

from . import conftest

pytestmark = [pytest.mark.cluster, pytest.mark.s3]

BUCKET = "cairn-plugin-test"
FILES = {
    "__0_0.distcp": b"a" * 300_000,
    "__1_0.distcp": b"b" * 200_000,
    "extra/.metadata": b"m" * 70,
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Store:
    """The bucket, a fresh prefix in it, and a client (from this machine)."""

    s3: Any
    prefix: str


@pytest.fixture
def store(devcluster: DevclusterHandle, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    creds = devcluster.s3_credentials
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", creds.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", creds.secret_key)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    client = boto3.client("s3", endpoint_url=devcluster.s3_endpoint)
    if BUCKET not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
        client.create_bucket(Bucket=BUCKET)
    prefix = f"jobs/{uuid.uuid4().hex[:8]}"
    yield Store(s3=client, prefix=prefix)
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for item in page.get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=item["Key"])


def upload_step(s3: Any, prefix: str, step: int, files: dict[str, bytes]) -> manifest.Manifest:
    folder = f"{prefix}/{manifest.step_dir_name(step)}"
    entries = []
    for rank, (path, data) in enumerate(files.items()):
        s3.put_object(Bucket=BUCKET, Key=f"{folder}/{path}", Body=data)
        crc = f"{checksums.crc32c(data):08x}"
        entries.append(manifest.FileEntry(path=path, size=len(data), crc32c=crc, rank=rank % 2))
    record = manifest.Manifest(
        step=step, world_size=2, attempt=1, created_at=0.0, files=tuple(entries)
    )
    s3.put_object(
        Bucket=BUCKET, Key=f"{folder}/{manifest.MANIFEST_NAME}", Body=manifest.dump_manifest(record)
    )
    return record


def job_with_upload(devcluster: DevclusterHandle, namespace: str, prefix: str) -> str:
    conftest.create_job(
        devcluster,
        namespace,
        "dl",
        checkpoint={
            "upload": {"uri": f"s3://{BUCKET}/{prefix}", "endpoint": "http://10.244.0.1:18333"}
        },
    )
    return "dl"


def download(devcluster: DevclusterHandle, namespace: str, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.main(
        [
            "--kubeconfig",
            str(devcluster.kubeconfig),
            "-n",
            namespace,
            "download",
            *args,
            "--endpoint",
            devcluster.s3_endpoint,
        ],
        out=out,
    )
    return code, out.getvalue()


def test_download_verified_step(
    devcluster: DevclusterHandle,
    namespace: str,
    store: Store,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = job_with_upload(devcluster, namespace, store.prefix)
    record = upload_step(store.s3, store.prefix, 40, FILES)
    target = tmp_path / "ckpt"
    code, out = download(devcluster, namespace, job, "--step", "40", "--to", str(target))
    assert code == 0, capsys.readouterr().err
    assert out == f"step 40 (3 files, 488.3KiB, world size 2) verified into {target}\n"
    for path, data in FILES.items():
        assert (target / path).read_bytes() == data
    assert manifest.parse_manifest((target / manifest.MANIFEST_NAME).read_bytes()) == record
    progress = capsys.readouterr().err.strip().splitlines()
    assert progress[-1].startswith("[" + "#" * 30 + "] 100%")
    assert progress[-1].endswith("488.3KiB/488.3KiB  3/3 files")
    # The same step again into the same folder: refused, nothing overwritten.
    assert download(devcluster, namespace, job, "--step", "40", "--to", str(target))[0] == 1
    assert "already holds a committed step" in capsys.readouterr().err


def test_corrupt_file_leaves_no_manifest(
    devcluster: DevclusterHandle,
    namespace: str,
    store: Store,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = job_with_upload(devcluster, namespace, store.prefix)
    upload_step(store.s3, store.prefix, 7, FILES)
    folder = f"{store.prefix}/{manifest.step_dir_name(7)}"
    store.s3.put_object(Bucket=BUCKET, Key=f"{folder}/__1_0.distcp", Body=b"c" * 200_000)
    target = tmp_path / "bad"
    assert download(devcluster, namespace, job, "--step", "7", "--to", str(target))[0] == 1
    assert "__1_0.distcp: CRC32C" in capsys.readouterr().err
    assert not (target / manifest.MANIFEST_NAME).exists()


def test_uncommitted_step(
    devcluster: DevclusterHandle,
    namespace: str,
    store: Store,
    tmp_path: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = job_with_upload(devcluster, namespace, store.prefix)
    folder = f"{store.prefix}/{manifest.step_dir_name(9)}"
    store.s3.put_object(Bucket=BUCKET, Key=f"{folder}/__0_0.distcp", Body=b"x")  # no manifest
    assert download(devcluster, namespace, job, "--step", "9", "--to", str(tmp_path / "x"))[0] == 1
    assert "has no manifest: the step is not committed remotely" in capsys.readouterr().err


def test_job_without_upload(
    devcluster: DevclusterHandle, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    conftest.create_job(devcluster, namespace, "local", checkpoint={})
    assert download(devcluster, namespace, "local", "--step", "1")[0] == 1
    assert "no spec.checkpoint.upload" in capsys.readouterr().err
