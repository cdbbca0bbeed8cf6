"""The operator's S3 side on the devcluster: verification, retention, onDelete, /metrics.

A suspended TrainingJob (no pods: the S3 pass does not depend on them) with
``upload`` (the devcluster's S3, credentials from a Secret), remote
``keepLast: 1`` and ``onDelete: Delete``, whose prefix was filled beforehand
with the writer's own upload code (steps 10, 20, 30 and an abandoned partial
15). Covers: ``status.storage.verifiedStep`` = 30 by CRC32C with the
``CheckpointVerified`` event; retention deleted steps 10, 20 and partial 15
(``RetentionDeleted``), 30 stays, and the rotation of step 20 took this
job's leftover of a killed attempt in its folder in the same pass; a step 40 whose object does not match its
manifest, announced by a writer-style ``lastUploaded`` patch, is reported
within seconds (the pass is kicked, not only every 30 s) as
``VerificationFailed`` and in ``corruptSteps``, never deleted, while the
verified step stays 30; the writer's ``checkpoints`` are untouched by the
operator; ``/metrics`` shows the job's verified step; deleting the job
(after its Secret, as a namespace deletion may) empties the prefix before
the finalizer goes and the job disappears. A job whose cleanup keeps failing
(its Secret never existed) shows ``CleanupFailed`` (``CleanupRetrying``,
naming its prefix) while the attempts go on, and is deleted anyway after
five attempts, with a ``CleanupFailed`` Warning.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import layout, options, remote, s3transport
from tests.conftest import DevclusterHandle, OperatorProcess
from tests.integration.devcluster import kube_helpers as kh

pytestmark = pytest.mark.cluster

GROUP, VERSION, PLURAL = "cairn.dev", "v1alpha1", "trainingjobs"
WAIT = 60.0
KICKED_WAIT = 20.0
"""Less than the 30 s pass interval plus its first run: the lastUploaded kick works."""
METRICS = "http://127.0.0.1:9090/metrics"
SECRET = "s3-creds"
FILES = {"__0_0.distcp": 4000, ".metadata": 300}


def write_step(
    opts: options.S3Options, tmp: pathlib.Path, step: int, *, job_uid: str, commit: bool = True
) -> dict[str, bytes]:
    """One step as the writer uploads it for the job `job_uid` (a job whose pods never
    started has no manifest key: its manifests are judged by job UID, docs/security.md)."""
    s3 = s3transport.make_client(opts)
    folder = tmp / manifest_mod.step_dir_name(step)
    folder.mkdir(parents=True)
    data = {name: os.urandom(size) for name, size in FILES.items()}
    for name, body in data.items():
        (folder / name).write_bytes(body)
    entries = tuple(layout.entry_for(folder, n, rank=0) for n in FILES)
    # The layout of an older Cairn: no data_prefix, keys directly under step-N/.
    record = manifest_mod.Manifest(
        step=step, world_size=1, attempt=1, created_at=0.0, files=entries, job_uid=job_uid
    )
    remote.upload_files(s3, opts, folder=folder, manifest=record, entries=entries)
    if commit:
        remote.put_manifest(s3, opts, record)
    return data


def keys(s3: Any, bucket: str, prefix: str) -> set[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {obj["Key"] for page in pages for obj in page.get("Contents", [])}


@pytest.fixture
def namespace(devcluster: DevclusterHandle) -> Iterator[str]:
    with contextlib.contextmanager(kh.temp_namespace)(devcluster.core, prefix="s3op") as name:
        yield name


def _suspended_job(name: str, *, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A suspended one-node job (no pods): only its S3 side is exercised."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "suspend": True,
            "nodes": 1,
            "image": "cairn-trainer:dev",
            "command": ["python", "-c", "pass"],
            "checkpoint": checkpoint,
        },
    }


def test_verify_retain_and_delete(
    devcluster: DevclusterHandle,
    operator: OperatorProcess,
    namespace: str,
    tmp_path: pathlib.Path,
) -> None:
    creds = devcluster.s3_credentials
    bucket = f"s3op-{uuid.uuid4().hex[:10]}"
    prefix = "runs/job-1"
    opts = options.S3Options(
        uri=f"s3://{bucket}/{prefix}",
        endpoint_url=devcluster.s3_endpoint,
        region="us-east-1",
        access_key=creds.access_key,
        secret_key=creds.secret_key,
    )
    s3: Any = s3transport.make_client(opts)
    s3.create_bucket(Bucket=bucket)
    try:
        _run(
            devcluster=devcluster,
            namespace=namespace,
            tmp_path=tmp_path,
            opts=opts,
            s3=s3,
            bucket=bucket,
            prefix=prefix,
        )
    finally:
        for key in keys(s3, bucket, ""):
            s3.delete_object(Bucket=bucket, Key=key)
        s3.delete_bucket(Bucket=bucket)


def _run(
    *,
    devcluster: DevclusterHandle,
    namespace: str,
    tmp_path: pathlib.Path,
    opts: options.S3Options,
    s3: Any,
    bucket: str,
    prefix: str,
) -> None:
    creds = devcluster.s3_credentials
    devcluster.core.create_namespaced_secret(
        namespace,
        kh.s3_secret(SECRET, access_key=creds.access_key, secret_key=creds.secret_key),
    )
    custom = client.CustomObjectsApi(devcluster.api_client)
    body = _suspended_job(
        "keep",
        checkpoint={
            "intervalSteps": 5,
            "upload": {
                "uri": f"s3://{bucket}/{prefix}",
                "endpoint": devcluster.s3_pod_endpoint,
                "credentialsSecretRef": {"name": SECRET},
            },
            "retention": {"remote": {"keepLast": 1}},
            "onDelete": "Delete",
        },
    )
    # The steps are the job's own (its UID in their manifests), so the job comes
    # first, without upload; the prefix gets the job's steps; then upload is
    # added (a suspended job's checkpoint may change): the first S3 pass sees
    # the whole prefix at once.
    full_checkpoint = body["spec"]["checkpoint"]
    body["spec"]["checkpoint"] = {"intervalSteps": 5}
    created = custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    uid = created["metadata"]["uid"]
    for step in (10, 20, 30):
        write_step(opts, tmp_path, step, job_uid=uid)
    write_step(opts, tmp_path, 15, job_uid=uid, commit=False)
    # Step 20 also holds this job's leftover of an attempt killed mid-upload
    # (attempt-scoped, listed by no manifest): its rotation takes it in the
    # same pass, so no manifest-less folder of ours stays behind.
    s3.put_object(
        Bucket=bucket, Key=f"{prefix}/step-000000020/a1-{uid[:8]}/__1_0.distcp", Body=b"x"
    )
    custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "keep", {"spec": {"checkpoint": full_checkpoint}}
    )

    def status() -> dict[str, Any]:
        job = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "keep")
        return dict(job.get("status") or {})

    def events(reason: str) -> list[Any]:
        items = devcluster.core.list_namespaced_event(
            namespace, field_selector="involvedObject.name=keep"
        ).items
        return [e for e in items if e.reason == reason]

    storage = kh.wait_for(
        lambda: (s := status().get("storage") or {}).get("remoteSteps") == [30] and s,
        timeout=WAIT,
        what="verification and retention in status.storage",
    )
    assert storage["verifiedStep"] == 30
    assert storage["verifiedBy"] == "crc32c"
    assert "lastError" not in storage
    base = f"{prefix}/"
    # The job's owner object (.cairn/owner.json) sits beside its step folders.
    assert {k.split("/")[2] for k in keys(s3, bucket, base)} == {"step-000000030", ".cairn"}
    (verified,) = kh.wait_for(lambda: events("CheckpointVerified"), timeout=WAIT, what="event")
    assert "step 30 verified in S3" in verified.message
    (deleted,) = kh.wait_for(lambda: events("RetentionDeleted"), timeout=WAIT, what="event")
    assert deleted.message == "deleted steps 10, 20, 15 from S3"

    # Step 40: uploaded with an object that does not match its manifest.
    data = write_step(opts, tmp_path, 40, job_uid=uid)
    s3.put_object(
        Bucket=bucket,
        Key=f"{prefix}/step-000000040/.metadata",
        Body=bytes(reversed(data[".metadata"])),
        ChecksumAlgorithm="CRC32C",
    )
    writer_report = {
        "status": {
            "checkpoints": {"lastUploaded": {"step": 40, "uri": opts.uri, "verified": False}}
        }
    }
    custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, "keep", writer_report, field_manager="test-writer"
    )
    started = time.monotonic()
    (failed,) = kh.wait_for(
        lambda: events("VerificationFailed"), timeout=KICKED_WAIT, what="VerificationFailed"
    )
    assert time.monotonic() - started < KICKED_WAIT
    assert failed.type == "Warning"
    assert failed.message.startswith("step 40 failed verification: .metadata has CRC32C")
    storage = kh.wait_for(
        lambda: (s := status().get("storage") or {}).get("corruptSteps") == [40] and s,
        timeout=WAIT,
        what="corruptSteps",
    )
    assert (storage["verifiedStep"], storage["remoteSteps"]) == (30, [30, 40])
    assert status()["checkpoints"] == {
        "lastUploaded": {"step": 40, "uri": opts.uri, "verified": False}
    }
    with urllib.request.urlopen(METRICS, timeout=5) as answer:
        text = answer.read().decode()
    assert f'cairn_trainingjob_verified_step{{name="keep",namespace="{namespace}"}} 30.0' in text

    # onDelete: Delete empties the prefix before the finalizer is released, even
    # with the Secret gone first (as in a namespace deletion): the operator
    # remembers the key pair it last read, in memory.
    devcluster.core.delete_namespaced_secret(SECRET, namespace)
    custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "keep")

    def gone() -> bool:
        try:
            custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "keep")
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    kh.wait_for(gone, timeout=WAIT, what="the job to be deleted")
    assert keys(s3, bucket, base) == set()


def test_cleanup_that_keeps_failing_does_not_wedge_deletion(
    devcluster: DevclusterHandle, operator: OperatorProcess, namespace: str
) -> None:
    """onDelete: Delete with a credentials Secret that does not exist: every
    cleanup attempt fails, then CleanupFailed (Warning) and the job is gone."""
    custom = client.CustomObjectsApi(devcluster.api_client)
    body = _suspended_job(
        "wedge",
        checkpoint={
            "upload": {
                "uri": "s3://nowhere/job",
                "endpoint": devcluster.s3_pod_endpoint,
                "credentialsSecretRef": {"name": "missing"},
            },
            "onDelete": "Delete",
        },
    )
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    kh.wait_for(
        lambda: (
            "missing"
            in str(
                (
                    custom.get_namespaced_custom_object(
                        GROUP, VERSION, namespace, PLURAL, "wedge"
                    ).get("status")
                    or {}
                )
                .get("storage", {})
                .get("lastError", "")
            )
        ),
        timeout=WAIT,
        what="lastError naming the missing Secret",
    )
    custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "wedge")

    def retrying() -> bool:  # while the attempts go on, the job says why it stays
        job = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "wedge")
        found = [
            c
            for c in (job.get("status") or {}).get("conditions") or ()
            if c.get("type") == "CleanupFailed" and c.get("reason") == "CleanupRetrying"
        ]
        return bool(found) and "s3://nowhere/job" in found[0]["message"]

    kh.wait_for(retrying, timeout=WAIT, what="CleanupFailed (CleanupRetrying) on the job")

    def gone() -> bool:
        try:
            custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "wedge")
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    started = time.monotonic()
    kh.wait_for(gone, timeout=120, what="the job to be deleted despite the failed cleanup")
    # 5 attempts: 2+4+8+16 s of backoff, each less up to half at random (core.backoff)
    assert time.monotonic() - started > 14
    (event,) = [
        e
        for e in devcluster.core.list_namespaced_event(
            namespace, field_selector="involvedObject.name=wedge"
        ).items
        if e.reason == "CleanupFailed"
    ]
    assert event.type == "Warning"
    assert event.message.startswith("S3 prefix s3://nowhere/job not emptied after 5 attempts:")
    assert "Secret" in event.message and "missing" in event.message
