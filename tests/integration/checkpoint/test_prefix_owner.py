"""The writer never uploads under another job's S3 prefix (real SeaweedFS on loopback).

Covers: an owner object naming another job is a configuration error (exit 78
in the reference trainer, the operator fails the job with the message); an
unreadable owner object is one too; this job's own owner object, or none at
all, lets the writer start; the check happens in `CheckpointManager`'s start
on rank 0, before anything touches the volume or the bucket; an absent owner
object is claimed there (If-None-Match, the operator's record format) when the
job's UID, namespace and name are known, and another job's is never replaced;
another job's owner object at an outer level (a prefix inside its prefix) is
a configuration error.
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


def test_writer_claims_an_unclaimed_prefix_before_its_first_upload(
    tmp_path: pathlib.Path, s3_server: typing.Any
) -> None:
    """Issue #20.6: the operator has not claimed it (yet, or never may): rank 0 does,
    with the operator's record, so a second job is refused by both sides."""
    bucket = s3_server.new_bucket("owner-claim")
    opts = _opts(s3_server, bucket)
    mine = s3owner.Owner(uid=ME, namespace="ml", name="me")
    with manager.CheckpointManager(
        options.CheckpointOptions(
            directory=tmp_path / "ckpt",
            s3=opts,
            job_uid=ME,
            job_namespace="ml",
            job_name="me",
            interval_steps=1,
        )
    ):
        pass
    key = f"jobs/shared/{s3owner.OWNER_KEY}"
    body = s3_server.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    assert s3owner.parse_owner(body) == mine
    client = s3transport.make_client(opts)
    remote.check_prefix_owner(client, opts, job_uid=ME, claim_as=mine)  # its own: fine
    with pytest.raises(errors.ConfigurationError, match="belongs to TrainingJob ml/me"):
        remote.check_prefix_owner(client, opts, job_uid=OTHER.uid, claim_as=OTHER)


def test_writer_never_replaces_another_jobs_owner_object(s3_server: typing.Any) -> None:
    bucket = s3_server.new_bucket("owner-keep")
    opts = _opts(s3_server, bucket)
    _put_owner(s3_server, bucket, OTHER.to_json())
    mine = s3owner.Owner(uid=ME, namespace="ml", name="me")
    with pytest.raises(errors.ConfigurationError, match="belongs to TrainingJob ml/other"):
        remote.check_prefix_owner(s3transport.make_client(opts), opts, job_uid=ME, claim_as=mine)
    key = f"jobs/shared/{s3owner.OWNER_KEY}"
    assert s3_server.client().get_object(Bucket=bucket, Key=key)["Body"].read() == OTHER.to_json()


def test_writer_refuses_a_prefix_inside_another_jobs(s3_server: typing.Any) -> None:
    """An owner object at an outer level (``jobs/``) names another job: every upload
    would sit inside that job's prefix, within reach of its retention and onDelete."""
    bucket = s3_server.new_bucket("owner-outer")
    opts = _opts(s3_server, bucket)
    s3_server.client().put_object(
        Bucket=bucket, Key=f"jobs/{s3owner.OWNER_KEY}", Body=OTHER.to_json()
    )
    mine = s3owner.Owner(uid=ME, namespace="ml", name="me")
    with pytest.raises(errors.ConfigurationError, match=r"inside s3://[^ ]+/jobs/, the prefix of"):
        remote.check_prefix_owner(s3transport.make_client(opts), opts, job_uid=ME, claim_as=mine)
    assert "Contents" not in s3_server.client().list_objects_v2(
        Bucket=bucket, Prefix="jobs/shared/"
    )
