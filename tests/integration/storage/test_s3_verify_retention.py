"""The operator's S3 edge and planner against a real S3 server (SeaweedFS on loopback).

Step folders are written with the writer's own upload code
(``cairn.checkpoint.remote``: per-file CRC32C, manifest last), then
``s3observe.observe`` + ``s3plan.plan`` run on them as the operator does.
Covers: good steps verified by the store's full-object CRC32C; a file
rewritten with other bytes of the same size and a truncated file not
verified; a multipart file uploaded by the writer (full-object CRC32C)
verified by CRC; a multipart file with a composite checksum only (an older
Cairn) verified by size and said so; retention deletes exactly the expected keys (keepLast + keepEvery,
abandoned partial, in-flight partial kept); deletions send every manifest
before the step's other objects (recorded with botocore's own event hooks);
``delete_prefix`` empties the job's step folders and leaves foreign objects
and other prefixes alone.
"""

from __future__ import annotations

import os
import pathlib
import typing
from typing import Any

import boto3.s3.transfer
import pytest

from cairn.api import checkpointspec
from cairn.api import manifest as manifest_mod
from cairn.checkpoint import layout, options, remote, s3transport
from cairn.devcluster import standalone_s3
from cairn.operator import s3apply, s3observe
from cairn.operator.core import s3plan

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

pytestmark = pytest.mark.s3

MiB = 1024 * 1024


class Store:
    def __init__(self, server: standalone_s3.S3Server, bucket: str, prefix: str) -> None:
        self.bucket, self.prefix = bucket, prefix
        self.uri = f"s3://{bucket}/{prefix}"
        self.opts = options.S3Options(
            uri=self.uri,
            endpoint_url=server.endpoint_url,
            region=server.region,
            access_key=server.access_key,
            secret_key=server.secret_key,
            part_size=5 * MiB,
        )
        self.writer = s3transport.make_client(self.opts)
        upload = checkpointspec.UploadSpec(uri=self.uri, endpoint=server.endpoint_url)
        self.s3: S3Client = s3observe.make_client(
            upload, access_key=server.access_key, secret_key=server.secret_key
        )
        self.target = s3observe.Target.parse(self.uri)

    def write_step(
        self, tmp: pathlib.Path, step: int, *, sizes: dict[str, int], commit: bool = True
    ) -> None:
        """A step as the writer leaves it: files uploaded, then (if commit) the manifest."""
        folder = tmp / manifest_mod.step_dir_name(step)
        folder.mkdir(parents=True)
        for name, size in sizes.items():
            (folder / name).write_bytes(os.urandom(size))
        entries = tuple(layout.entry_for(folder, n, rank=0) for n in sizes)
        # The layout of an older Cairn: no data_prefix, keys directly under step-N/.
        manifest = manifest_mod.Manifest(
            step=step, world_size=1, attempt=1, created_at=0.0, files=entries
        )
        remote.upload_files(
            self.writer, self.opts, folder=folder, manifest=manifest, entries=entries
        )
        if commit:
            remote.put_manifest(self.writer, self.opts, manifest)

    def listed(self) -> set[str]:
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket)
        return {obj["Key"] for page in pages for obj in page.get("Contents", [])}

    def plan(self, **kw: Any) -> s3plan.RemotePlan:
        seen = s3observe.observe(self.s3, self.target)
        return s3plan.plan(listing=seen.listing, manifests=seen.manifests, **kw)


SMALL = {"__0_0.distcp": 3000, ".metadata": 200}


@pytest.fixture
def store(s3_server: standalone_s3.S3Server) -> Store:
    return Store(s3_server, s3_server.new_bucket("storage"), "team/job-a")


def test_verified_by_crc32c_and_corruption_detected(store: Store, tmp_path: pathlib.Path) -> None:
    for step in (10, 20, 30):
        store.write_step(tmp_path, step, sizes=SMALL)
    # Same size, other bytes (a silent corruption); and a truncated file.
    other = os.urandom(3000)
    store.s3.put_object(
        Bucket=store.bucket,
        Key=store.target.key(20, "__0_0.distcp"),
        Body=other,
        ChecksumAlgorithm="CRC32C",
    )
    store.s3.put_object(
        Bucket=store.bucket,
        Key=store.target.key(30, ".metadata"),
        Body=b"short",
        ChecksumAlgorithm="CRC32C",
    )
    result = store.plan(remote=None)
    verdicts = {v.step: v for v in result.verdicts}
    assert (verdicts[10].verified, verdicts[10].method, verdicts[10].reason) == (True, "crc32c", "")
    assert not verdicts[20].verified
    assert "__0_0.distcp has CRC32C" in verdicts[20].reason
    assert not verdicts[30].verified
    assert ".metadata has 5 bytes, manifest says 200" in verdicts[30].reason
    assert result.newest_verified is not None
    assert result.newest_verified.step == 10


def test_multipart_file_is_verified_by_its_full_object_crc(
    store: Store, tmp_path: pathlib.Path
) -> None:
    # The writer sends the whole-file CRC32C (ChecksumType=FULL_OBJECT).
    store.write_step(tmp_path, 5, sizes={"__0_0.distcp": 6 * MiB, ".metadata": 100})
    result = store.plan(remote=None)
    (verdict,) = result.verdicts
    assert (verdict.verified, verdict.method, verdict.reason) == (True, "crc32c", "")


def test_composite_multipart_file_is_verified_by_size_and_says_so(
    store: Store, tmp_path: pathlib.Path
) -> None:
    """An object uploaded with per-part checksums only (an older Cairn) has a
    composite checksum, which is not a file CRC: size only, and said so."""
    folder = tmp_path / "composite"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(os.urandom(6 * MiB))
    entries = (layout.entry_for(folder, "__0_0.distcp", rank=0),)
    store.writer.upload_file(
        str(folder / "__0_0.distcp"),
        store.bucket,
        store.target.key(5, "__0_0.distcp"),
        ExtraArgs={"ChecksumAlgorithm": "CRC32C"},
        Config=boto3.s3.transfer.TransferConfig(
            multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB
        ),
    )
    record = manifest_mod.Manifest(step=5, world_size=1, attempt=1, created_at=0.0, files=entries)
    remote.put_manifest(store.writer, store.opts, record)
    (verdict,) = store.plan(remote=None).verdicts
    assert (verdict.verified, verdict.method) == (True, "size")
    assert "1 of 1 files checked by size only" in verdict.reason


def test_retention_deletes_exactly_the_expected_keys(store: Store, tmp_path: pathlib.Path) -> None:
    for step in (10, 20, 30, 40, 50):
        store.write_step(tmp_path, step, sizes=SMALL)
    store.write_step(tmp_path, 15, sizes=SMALL, commit=False)  # abandoned partial
    store.write_step(tmp_path, 60, sizes=SMALL, commit=False)  # may still be uploading
    foreign = f"{store.prefix}/notes.txt"
    store.s3.put_object(Bucket=store.bucket, Key=foreign, Body=b"mine")
    before = store.listed()

    calls: list[tuple[str, list[str]]] = []

    def record(model: Any, params: dict[str, Any], **_: Any) -> None:
        if model.name == "DeleteObject":
            calls.append(("one", [params["Key"]]))
        elif model.name == "DeleteObjects":
            calls.append(("batch", [o["Key"] for o in params["Delete"]["Objects"]]))

    store.s3.meta.events.register("provide-client-params.s3.*", record)
    result = store.plan(
        remote=checkpointspec.RemoteRetention(keep_last=2, keep_every=20),
        protected=frozenset({10}),  # resumed from
        last_committed=60,
    )
    assert result.verified_steps == (10, 20, 30, 40, 50)
    assert result.deleted_steps == (30, 15)
    deleted = s3apply.delete_steps(store.s3, store.target, result.deletions)
    assert deleted == (30, 15)

    expected_gone = {store.target.key(30, p) for p in [*SMALL, "manifest.json"]} | {
        store.target.key(15, p) for p in SMALL
    }
    assert store.listed() == before - expected_gone
    assert foreign in store.listed()
    # Step 30: its manifest went alone, before the batch with its files.
    assert calls[0] == ("one", [store.target.key(30, "manifest.json")])
    assert sorted(calls[1][1]) == sorted(store.target.key(30, p) for p in SMALL)
    # The next pass sees the same world and deletes nothing more.
    again = store.plan(
        remote=checkpointspec.RemoteRetention(keep_last=2, keep_every=20),
        protected=frozenset({10}),
        last_committed=60,
    )
    assert again.deletions == ()
    assert again.kept == (10, 20, 40, 50)


def test_delete_prefix_empties_the_jobs_step_folders_only(
    store: Store, tmp_path: pathlib.Path
) -> None:
    for step in (1, 2):
        store.write_step(tmp_path / "a", step, sizes=SMALL)
    store.write_step(tmp_path / "a", 3, sizes=SMALL, commit=False)
    sibling = f"{store.prefix}-2/step-000000001/manifest.json"  # job-a-2 is another job
    store.s3.put_object(Bucket=store.bucket, Key=sibling, Body=b"{}")
    foreign = f"{store.prefix}/README"
    store.s3.put_object(Bucket=store.bucket, Key=foreign, Body=b"kept")

    calls: list[str] = []

    def record(model: Any, params: dict[str, Any], **_: Any) -> None:
        if model.name in ("DeleteObject", "DeleteObjects"):
            calls.append(model.name)

    store.s3.meta.events.register("provide-client-params.s3.*", record)
    count = s3apply.delete_prefix(store.s3, store.target)
    assert count == 2 * 3 + 2
    assert store.listed() == {sibling, foreign}
    assert calls == ["DeleteObject", "DeleteObject", "DeleteObjects"]
