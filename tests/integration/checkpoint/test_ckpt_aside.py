"""Moving steps aside (cairn.checkpoint.aside) on real folders and the real S3 server.

Covers: a local step folder is renamed under `.cairn/<kind>/<tag>/` with a
reason file beside it, bytes unchanged (nothing added inside); moving the
same step name twice never overwrites (a suffix is added), also after a
crash between the reason file and the rename; bad kinds, tags and
non-children are refused with the folder left in place; in S3 the manifest's raw bytes (unknown fields and
all) are copied aside and the original removed while data objects stay; a
repeated call after an interruption (copy done, original gone or still
present) finishes without a second copy; a missing manifest is an error.
"""

from __future__ import annotations

import os
import pathlib
import typing

import pytest

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import aside, errors, layout, options, remote, s3transport


def make_step(root: pathlib.Path, step: int) -> pathlib.Path:
    folder = layout.step_dir(root, step)
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(os.urandom(1000))
    (folder / ".metadata").write_bytes(b"meta")
    (folder / manifest_mod.MANIFEST_NAME).write_text('{"format_version": 1}')
    return folder


def snapshot(folder: pathlib.Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_local_step_is_renamed_under_kind_and_tag_with_reason(tmp_path: pathlib.Path) -> None:
    folder = make_step(tmp_path, 7)
    before = snapshot(folder)
    moved = aside.move_aside_local(
        tmp_path, folder, kind="quarantine", tag="abcd1234-a2", reason="crc32c mismatch"
    )
    assert moved == tmp_path / ".cairn" / "quarantine" / "abcd1234-a2" / folder.name
    assert not folder.exists()
    assert snapshot(moved) == before
    reason = (moved.parent / f"{folder.name}{aside.REASON_SUFFIX}").read_text()
    assert "crc32c mismatch" in reason
    assert "quarantine" in reason
    # No longer a step of the main namespace.
    assert layout.step_dirs(tmp_path) == {}


def test_same_step_twice_gets_a_suffix_never_overwrites(tmp_path: pathlib.Path) -> None:
    first = aside.move_aside_local(
        tmp_path, make_step(tmp_path, 5), kind="superseded", tag="lin-a0", reason="one"
    )
    first_bytes = snapshot(first)
    second = aside.move_aside_local(
        tmp_path, make_step(tmp_path, 5), kind="superseded", tag="lin-a0", reason="two"
    )
    assert second.name == f"{first.name}.1"
    assert snapshot(first) == first_bytes
    assert "two" in (second.parent / f"{second.name}{aside.REASON_SUFFIX}").read_text()


@pytest.mark.parametrize(
    ("kind", "tag"),
    [("trash", "x"), ("quarantine", "../up"), ("quarantine", "a/b"), ("quarantine", "")],
)
def test_bad_kind_or_tag_is_refused_and_nothing_moves(
    tmp_path: pathlib.Path, kind: str, tag: str
) -> None:
    folder = make_step(tmp_path, 1)
    with pytest.raises(ValueError):
        aside.move_aside_local(
            tmp_path,
            folder,
            kind=typing.cast(aside.Kind, kind),
            tag=tag,
            reason="x",
        )
    assert folder.is_dir()


def test_folder_outside_root_is_refused(tmp_path: pathlib.Path) -> None:
    folder = make_step(tmp_path / "other", 1)
    with pytest.raises(ValueError, match="not a direct child"):
        aside.move_aside_local(tmp_path, folder, kind="quarantine", tag="t", reason="x")
    assert folder.is_dir()


def test_crash_between_reason_and_rename_keeps_the_step_then_moves_it_to_a_free_name(
    tmp_path: pathlib.Path,
) -> None:
    """The kill trials' quarantine pause point: a reason file beside no folder."""
    folder = make_step(tmp_path, 3)
    before = snapshot(folder)

    def crash() -> None:
        raise RuntimeError("killed mid-quarantine")

    with pytest.raises(RuntimeError):
        aside.move_aside_local(
            tmp_path, folder, kind="quarantine", tag="t-a0", reason="one", before_rename=crash
        )
    assert snapshot(folder) == before  # still in place, untouched
    parent = aside.aside_dir(tmp_path, kind="quarantine", tag="t-a0")
    assert (parent / f"{folder.name}{aside.REASON_SUFFIX}").is_file()
    moved = aside.move_aside_local(tmp_path, folder, kind="quarantine", tag="t-a0", reason="two")
    assert moved.name == f"{folder.name}.1"  # the orphan reason's name is not reused
    assert snapshot(moved) == before
    assert [e.folder for e in aside.observe(tmp_path)] == [moved]


# -- S3 ----------------------------------------------------------------------


def s3opts(server: typing.Any, bucket: str) -> options.S3Options:
    return options.S3Options(
        uri=f"s3://{bucket}/jobs/demo",
        endpoint_url=server.endpoint_url,
        region=server.region,
        access_key=server.access_key,
        secret_key=server.secret_key,
    )


def all_keys(client: typing.Any, bucket: str) -> dict[str, bytes]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    names = [obj["Key"] for page in pages for obj in page.get("Contents", [])]
    return {name: client.get_object(Bucket=bucket, Key=name)["Body"].read() for name in names}


# Raw bytes with an unknown field and odd spacing: a copy must not re-dump them.
RAW_MANIFEST = b'{"format_version": 1,  "step": 4, "future_field": {"x": 1}}\n'


def put_step(client: typing.Any, bucket: str, step: int) -> None:
    prefix = f"jobs/demo/{manifest_mod.step_dir_name(step)}"
    client.put_object(Bucket=bucket, Key=f"{prefix}/a1-abcd/__0_0.distcp", Body=b"data0")
    client.put_object(Bucket=bucket, Key=f"{prefix}/manifest.json", Body=RAW_MANIFEST)


@pytest.mark.s3
def test_remote_manifest_is_copied_raw_then_removed_data_untouched(
    s3_server: typing.Any,
) -> None:
    bucket = s3_server.new_bucket("aside-remote")
    opts = s3opts(s3_server, bucket)
    client = s3transport.make_client(opts)
    put_step(client, bucket, 4)
    key = aside.move_aside_remote(
        client, opts, 4, kind="quarantine", tag="abcd1234-a1", reason="crc mismatch"
    )
    assert key == "jobs/demo/.cairn/quarantine/abcd1234-a1/step-000000004/manifest.json"
    objects = all_keys(client, bucket)
    assert objects[key] == RAW_MANIFEST
    assert "jobs/demo/step-000000004/manifest.json" not in objects
    assert objects["jobs/demo/step-000000004/a1-abcd/__0_0.distcp"] == b"data0"
    reason = objects["jobs/demo/.cairn/quarantine/abcd1234-a1/step-000000004.reason.txt"]
    assert b"crc mismatch" in reason
    assert remote.committed_steps(client, opts) == []


@pytest.mark.s3
def test_remote_repeat_after_interruption_finishes_without_second_copy(
    s3_server: typing.Any,
) -> None:
    bucket = s3_server.new_bucket("aside-repeat")
    opts = s3opts(s3_server, bucket)
    client = s3transport.make_client(opts)
    put_step(client, bucket, 4)
    parent = aside.aside_prefix(opts, kind="superseded", tag="lin")
    # Interrupted after the copy, before deleting the original.
    client.put_object(
        Bucket=bucket, Key=f"{parent}/step-000000004/manifest.json", Body=RAW_MANIFEST
    )
    key = aside.move_aside_remote(client, opts, 4, kind="superseded", tag="lin", reason="r")
    assert key == f"{parent}/step-000000004/manifest.json"
    # Called again once the original is gone: the existing copy is the answer.
    again = aside.move_aside_remote(client, opts, 4, kind="superseded", tag="lin", reason="r")
    assert again == key
    manifests = [k for k in all_keys(client, bucket) if k.endswith("manifest.json")]
    assert manifests == [key]


@pytest.mark.s3
def test_remote_same_step_with_other_content_gets_a_suffix(s3_server: typing.Any) -> None:
    bucket = s3_server.new_bucket("aside-suffix")
    opts = s3opts(s3_server, bucket)
    client = s3transport.make_client(opts)
    parent = aside.aside_prefix(opts, kind="foreign", tag="ffff")
    client.put_object(Bucket=bucket, Key=f"{parent}/step-000000004/manifest.json", Body=b"older")
    put_step(client, bucket, 4)
    key = aside.move_aside_remote(client, opts, 4, kind="foreign", tag="ffff", reason="r")
    assert key == f"{parent}/step-000000004.1/manifest.json"
    objects = all_keys(client, bucket)
    assert objects[f"{parent}/step-000000004/manifest.json"] == b"older"
    assert objects[key] == RAW_MANIFEST


@pytest.mark.s3
def test_remote_missing_manifest_is_an_error(s3_server: typing.Any) -> None:
    bucket = s3_server.new_bucket("aside-missing")
    opts = s3opts(s3_server, bucket)
    client = s3transport.make_client(opts)
    with pytest.raises(errors.CheckpointError, match="nothing moved aside"):
        aside.move_aside_remote(client, opts, 9, kind="quarantine", tag="t", reason="r")
