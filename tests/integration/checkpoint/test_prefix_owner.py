"""The writer never uploads under another job's S3 prefix (real SeaweedFS on loopback).

Covers: an owner object naming another job is a configuration error (exit 78
in the reference trainer, the operator fails the job with the message); an
unreadable owner object is one too; this job's own owner object, or none at
all, lets the writer start; the check happens in `CheckpointManager`'s start
on rank 0, before anything touches the volume or the bucket.
"""

from __future__ import annotations

import pathlib
import typing

import pytest

from cairn.api import s3owner
from cairn.checkpoint import errors, manager, options, remote, s3transport

pytestmark = [
    pytest.mark.s3,
    pytest.mark.filterwarnings(
        "ignore:torch.distributed is disabled:UserWarning",
        "ignore:torch.distributed is unavailable:UserWarning",
    ),
]

ME = "0f1e2d3c-aaaa-bbbb-cccc-000000000001"
OTHER = s3owner.Owner(uid="9a8b7c6d-0000-0000-0000-000000000002", namespace="ml", name="other")


def _opts(server: typing.Any, bucket: str) -> options.S3Options:
    return options.S3Options(
        uri=f"s3://{bucket}/jobs/shared",
        endpoint_url=server.endpoint_url,
        region=server.region,
        access_key=server.access_key,
        secret_key=server.secret_key,
    )


def _put_owner(server: typing.Any, bucket: str, body: bytes) -> None:
    server.client().put_object(Bucket=bucket, Key=f"jobs/shared/{s3owner.OWNER_KEY}", Body=body)


def test_prefix_owned_by_another_job_is_a_configuration_error(s3_server: typing.Any) -> None:
    bucket = s3_server.new_bucket("owner-other")
    opts = _opts(s3_server, bucket)
    _put_owner(s3_server, bucket, OTHER.to_json())
    with pytest.raises(errors.ConfigurationError, match=r"belongs to TrainingJob ml/other"):
        remote.check_prefix_owner(s3transport.make_client(opts), opts, job_uid=ME)


def test_unreadable_owner_object_is_a_configuration_error(s3_server: typing.Any) -> None:
    bucket = s3_server.new_bucket("owner-garbage")
    opts = _opts(s3_server, bucket)
    _put_owner(s3_server, bucket, b"\x00not json")
    with pytest.raises(errors.ConfigurationError, match="cannot be read"):
        remote.check_prefix_owner(s3transport.make_client(opts), opts, job_uid=ME)


def test_own_or_absent_owner_object_lets_the_writer_start(s3_server: typing.Any) -> None:
    bucket = s3_server.new_bucket("owner-mine")
    opts = _opts(s3_server, bucket)
    client = s3transport.make_client(opts)
    remote.check_prefix_owner(client, opts, job_uid=ME)  # absent: the operator claims it
    mine = s3owner.Owner(uid=ME, namespace="ml", name="me")
    _put_owner(s3_server, bucket, mine.to_json())
    remote.check_prefix_owner(client, opts, job_uid=ME)


def test_manager_refuses_to_start_on_another_jobs_prefix(
    tmp_path: pathlib.Path, s3_server: typing.Any
) -> None:
    bucket = s3_server.new_bucket("owner-manager")
    opts = _opts(s3_server, bucket)
    _put_owner(s3_server, bucket, OTHER.to_json())
    root = tmp_path / "ckpt"
    with pytest.raises(errors.ConfigurationError, match="belongs to TrainingJob"):
        manager.CheckpointManager(
            options.CheckpointOptions(directory=root, s3=opts, job_uid=ME, interval_steps=1)
        )
    # Refused before the volume was touched: no fence, no folders.
    assert not root.exists() or not any(root.iterdir())
