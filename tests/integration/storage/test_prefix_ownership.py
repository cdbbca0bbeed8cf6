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
- a job whose prefix is inside an owned prefix (issue #20.6): ``PrefixNested``
  naming the outer job, no call under the inner prefix, the outer keeps it;
- an endpoint that is a name for loopback, with the chart's default settings
  (an S3 pass run in this process; issue #20.5): ``EndpointAddressRefused``
  with the generic message, no address in status or Event, the detail in the
  operator log, and the real S3 behind the name got nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import pathlib
import urllib.parse
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from cairn.api import trainingjob
from cairn.checkpoint import options
from cairn.operator import egress, kubeapi, prefixapply, s3observe, s3pass
from cairn.operator.core import egressplan, jobobserve, prefixplan
from tests.conftest import DevclusterHandle, OperatorProcess
from tests.integration.devcluster import kube_helpers as kh
from tests.integration.storage.test_storage_operator import (
    GROUP,
    PLURAL,
    SECRET,
    VERSION,
    WAIT,
    _suspended_job,
    keys,
    write_step,
)

pytestmark = pytest.mark.cluster
OWNER = ".cairn/owner.json"


class Env:
    """A namespace with the S3 Secret, a fresh bucket, and the calls these tests repeat."""

    def __init__(self, devcluster: DevclusterHandle, namespace: str, bucket: str) -> None:
        self.devcluster = devcluster
        self.namespace = namespace
        self.bucket = bucket
        self.custom = client.CustomObjectsApi(devcluster.api_client)
        creds = devcluster.s3_credentials
        self.opts = options.S3Options(
            uri=f"s3://{bucket}/shared/run",
            endpoint_url=devcluster.s3_endpoint,
            region="us-east-1",
            access_key=creds.access_key,
            secret_key=creds.secret_key,
        )
        self.s3: Any = devcluster.target.s3_client()

    def upload(self, **fields: Any) -> dict[str, Any]:
        return {
            "uri": self.opts.uri,
            "endpoint": self.devcluster.s3_pod_endpoint,
            "credentialsSecretRef": {"name": SECRET},
            **fields,
        }

    def create(self, body: dict[str, Any]) -> None:
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, body)

    def job(self, name: str) -> dict[str, Any]:
        job: dict[str, Any] = self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name
        )
        return job

    def claim(self, name: str) -> dict[str, Any]:
        return dict(((self.job(name).get("status") or {}).get("storage") or {}).get("claim") or {})

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        found = [
            c for c in self.job(name).get("status", {}).get("conditions") or () if c["type"] == kind
        ]
        return dict(found[0]) if found else {}

    def wait_refused(self, name: str, reason: str) -> dict[str, Any]:
        found: dict[str, Any] = kh.wait_for(
            lambda: (
                (c := self.condition(name, "StorageRefused")).get("reason") == reason
                and c.get("status") == "True"
                and c
            ),
            timeout=WAIT,
            what=f"StorageRefused={reason} on {name}",
        )
        return found

    def events(self, name: str, reason: str) -> list[Any]:
        items = self.devcluster.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={name}"
        ).items
        return [e for e in items if e.reason == reason]

    def delete_and_wait(self, name: str, *, timeout: float = WAIT) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)

        def gone() -> bool:
            try:
                self.job(name)
            except ApiException as exc:
                if exc.status == 404:
                    return True
                raise
            return False

        kh.wait_for(gone, timeout=timeout, what=f"{name} to be deleted")

    def owner(self) -> dict[str, Any]:
        body = self.s3.get_object(Bucket=self.bucket, Key=f"shared/run/{OWNER}")["Body"].read()
        return dict(json.loads(body))


@pytest.fixture
def env(devcluster: DevclusterHandle, operator: OperatorProcess) -> Iterator[Env]:
    with contextlib.contextmanager(kh.temp_namespace)(
        devcluster.core, prefix="prefix"
    ) as namespace:
        bucket = f"claim-{uuid.uuid4().hex[:10]}"
        found = Env(devcluster, namespace, bucket)
        found.s3.create_bucket(Bucket=bucket)
        creds = devcluster.s3_credentials
        devcluster.core.create_namespaced_secret(
            namespace,
            client.V1Secret(
                metadata=client.V1ObjectMeta(name=SECRET),
                string_data={
                    "AWS_ACCESS_KEY_ID": creds.access_key,
                    "AWS_SECRET_ACCESS_KEY": creds.secret_key,
                },
            ),
        )
        try:
            yield found
        finally:
            for key in keys(found.s3, bucket, ""):
                found.s3.delete_object(Bucket=bucket, Key=key)
            found.s3.delete_bucket(Bucket=bucket)


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


def test_prefix_nested_in_an_owned_prefix_is_refused(env: Env) -> None:
    """Issue #20.6: the outer job keeps its prefix; the inner one is refused, naming it."""
    env.create(_suspended_job("outer", checkpoint={"upload": env.upload()}))
    kh.wait_for(lambda: env.claim("outer").get("owned") is True, timeout=WAIT, what="outer's claim")
    inner_uri = f"s3://{env.bucket}/shared/run/inner"
    env.create(_suspended_job("inner", checkpoint={"upload": env.upload(uri=inner_uri)}))
    refused = env.wait_refused("inner", "PrefixNested")
    assert f"inside the prefix s3://{env.bucket}/shared/run/" in refused["message"]
    assert f"TrainingJob {env.namespace}/outer" in refused["message"]
    assert keys(env.s3, env.bucket, "shared/run/inner/") == set()  # no owner object, no call
    assert env.claim("outer").get("owned") is True


def test_loopback_endpoint_is_refused_with_a_generic_message(
    env: Env, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue #20.5, with the chart's default settings (no allow-list), run in this
    process: the endpoint is a name for the devcluster's real S3 on loopback, so a
    missing gate would have claimed the prefix there."""
    monkeypatch.setattr(prefixapply, "settings", prefixplan.Settings)
    port = urllib.parse.urlsplit(env.devcluster.s3_endpoint).port
    body = _suspended_job(
        "loop", checkpoint={"upload": env.upload(endpoint=f"http://localhost:{port}")}
    )
    body["spec"]["managedBy"] = "kueue.x-k8s.io/multikueue"  # the shared operator stays out
    env.create(body)
    raw = env.job("loop")
    job = jobobserve.parse_job(raw)
    assert isinstance(job, trainingjob.TrainingJob)
    with caplog.at_level(logging.WARNING, logger=egress.LOG.name):
        s3pass.storage_pass(
            api=kubeapi.KubeApi.of(env.devcluster.api_client),
            raw=raw,
            job=job,
            caches=s3observe.Caches(),
            now=lambda: datetime.datetime.now(datetime.UTC),
        )
    assert env.claim("loop") == {
        "owned": False,
        "reason": prefixplan.REASON_ADDRESS,
        "message": egressplan.REFUSED_MESSAGE,
    }
    status = json.dumps(env.job("loop")["status"])
    assert "127.0.0.1" not in status and "::1" not in status and "lastError" not in status
    assert keys(env.s3, env.bucket, "") == set()  # the real S3 behind the name got nothing
    assert "localhost resolves to" in caplog.text  # the detail: the operator log only
    (event,) = env.events("loop", prefixplan.REASON_ADDRESS)
    assert event.type == "Warning" and "127.0.0.1" not in event.message
