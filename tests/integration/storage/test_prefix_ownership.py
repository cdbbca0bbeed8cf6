"""S3 prefix ownership and the operator's S3 settings, on the devcluster's real S3.

Covers, with the shared operator (started by ``demo.start_operator`` with
``CAIRN_S3_ENDPOINT_ALLOWLIST`` = the devcluster's S3 endpoints and the
operator identity off, as the chart defaults):

- two jobs on one prefix: the first claims it (``.cairn/owner.json`` with its
  UID, created with If-None-Match), verifies it; the second gets
  ``StorageRefused`` = True, reason ``PrefixOwnedByAnotherJob`` naming the
  first, and a Warning Event; its ``keepLast: 1`` deletes nothing; deleting it
  with ``onDelete: Delete`` posts ``CleanupSkipped`` and the first's
  checkpoints and owner object survive;
- a job without ``credentialsSecretRef``: ``OperatorIdentityNotAllowed``, and
  no S3 call (no owner object, no ``lastError``);
- a job whose endpoint is not in the allow-list (the cloud metadata address):
  ``EndpointNotAllowed``, no S3 call (no ``lastError``);
- ``onDelete: Delete`` of a running job waits until its pods are gone: a rank
  that uploads an object after SIGTERM does not leave it behind, and the
  owner object is released.

A prefix nested in an owned one and an endpoint on loopback (issue #20) are
the storage cases of ``tests/e2e/test_adversary.py``; both modules' ``env``
is ``prefixenv.prepared``.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from tests.conftest import DevclusterHandle, OperatorProcess
from tests.integration.devcluster import kube_helpers as kh
from tests.integration.storage import prefixenv
from tests.integration.storage.prefixenv import Env
from tests.integration.storage.test_storage_operator import WAIT, _suspended_job, keys, write_step

pytestmark = pytest.mark.cluster


@pytest.fixture
def env(devcluster: DevclusterHandle, operator: OperatorProcess) -> Iterator[Env]:
    with prefixenv.prepared(devcluster) as found:
        yield found


def test_second_job_on_an_owned_prefix_is_refused(env: Env, tmp_path: pathlib.Path) -> None:
    env.create(
        _suspended_job(
            "first",
            checkpoint={"upload": env.upload(), "retention": {"remote": {"keepLast": 5}}},
        )
    )
    for step in (10, 20):  # the first job's own steps: its UID in their manifests
        write_step(
            env.opts, tmp_path / str(step), step, job_uid=env.job("first")["metadata"]["uid"]
        )
    kh.wait_for(
        lambda: env.claim("first").get("owned") is True,
        timeout=WAIT,
        what="the first job to claim the prefix",
    )
    first_uid = env.job("first")["metadata"]["uid"]
    assert env.owner() == {"uid": first_uid, "namespace": env.namespace, "name": "first"}
    before = keys(env.s3, env.bucket, "shared/run/")
    kh.wait_for(
        lambda: (env.job("first").get("status") or {}).get("storage", {}).get("verifiedStep") == 20,
        timeout=WAIT,
        what="the owner verifying its prefix",
    )

    env.create(
        _suspended_job(
            "second",
            checkpoint={
                "upload": env.upload(),
                "retention": {"remote": {"keepLast": 1}},
                "onDelete": "Delete",
            },
        )
    )
    refused = env.wait_refused("second", "PrefixOwnedByAnotherJob")
    assert f"{env.namespace}/first (uid {first_uid})" in refused["message"]
    (event,) = kh.wait_for(
        lambda: env.events("second", "PrefixOwnedByAnotherJob"), timeout=WAIT, what="the event"
    )
    assert event.type == "Warning"
    storage = env.job("second")["status"]["storage"]
    assert storage["claim"]["owned"] is False
    assert "verifiedStep" not in storage  # not verified, not retained: not its prefix
    assert env.condition("first", "StorageRefused")["status"] == "False"

    env.delete_and_wait("second")
    (skipped,) = kh.wait_for(
        lambda: env.events("second", "CleanupSkipped"), timeout=WAIT, what="CleanupSkipped"
    )
    assert "owned by TrainingJob" in skipped.message
    assert keys(env.s3, env.bucket, "shared/run/") == before
    assert env.owner()["uid"] == first_uid


def test_operator_identity_is_refused_by_default(env: Env) -> None:
    upload = env.upload()
    del upload["credentialsSecretRef"]
    env.create(_suspended_job("anon", checkpoint={"upload": upload}))
    refused = env.wait_refused("anon", "OperatorIdentityNotAllowed")
    assert "s3.allowOperatorIdentity" in refused["message"]
    (event,) = kh.wait_for(
        lambda: env.events("anon", "OperatorIdentityNotAllowed"), timeout=WAIT, what="event"
    )
    assert event.type == "Warning"
    assert keys(env.s3, env.bucket, "") == set()
    assert "lastError" not in env.job("anon")["status"]["storage"]


def test_endpoint_outside_the_allow_list_is_refused(env: Env) -> None:
    env.create(
        _suspended_job("ssrf", checkpoint={"upload": env.upload(endpoint="http://169.254.169.254")})
    )
    refused = env.wait_refused("ssrf", "EndpointNotAllowed")
    assert "http://169.254.169.254" in refused["message"]
    assert env.devcluster.s3_pod_endpoint in refused["message"]
    assert "lastError" not in env.job("ssrf")["status"]["storage"]


LATE_UPLOAD = """
import os, signal, sys, time
import boto3

def late(*_):
    time.sleep(2)  # still uploading after SIGTERM, as a final checkpoint would be
    s3 = boto3.client("s3", region_name="us-east-1")
    bucket, prefix = os.environ["CAIRN_UPLOAD_URI"][5:].split("/", 1)
    s3.put_object(Bucket=bucket, Key=f"{prefix}/step-000000050/late.bin", Body=b"x")
    s3.put_object(Bucket=bucket, Key="markers/late-done", Body=b"x")
    sys.exit(0)

signal.signal(signal.SIGTERM, late)
while True:
    time.sleep(1)
"""


def test_on_delete_waits_for_the_pods(env: Env) -> None:
    body = _suspended_job(
        "busy",
        checkpoint={
            "upload": env.upload(),
            "onDelete": "Delete",
            "finalCheckpointGraceSeconds": 30,
        },
    )
    body["spec"]["suspend"] = False
    body["spec"]["command"] = ["python", "-c", LATE_UPLOAD]
    env.create(body)
    kh.wait_for(
        lambda: (
            (env.job("busy").get("status") or {}).get("phase") == "Running"
            and env.claim("busy").get("owned") is True
        ),
        timeout=WAIT,
        what="the job running with its prefix claimed",
    )
    env.delete_and_wait("busy", timeout=WAIT + 30)
    assert (
        env.devcluster.core.list_namespaced_pod(
            env.namespace, label_selector="cairn.dev/job-name=busy"
        ).items
        == []
    )
    assert keys(env.s3, env.bucket, "markers/") == {"markers/late-done"}
    assert keys(env.s3, env.bucket, "shared/run/") == set()  # owner released too
