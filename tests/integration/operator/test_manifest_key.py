"""The job's manifest key on a real API server, and the operator's S3 pass checking it.

Covers (devcluster, the shared operator, the devcluster's S3): creating a
TrainingJob makes a Secret ``<job>-manifest-key`` owned by the job (controller
ownerReference) holding a keyring with one 32-byte key; every rank's trainer
container mounts it read-only and is told the file's path (never the key) in
``CAIRN_MANIFEST_KEYRING``, and each rank reads it; no key appears in the pod
specs, the job's status or its events. The operator's S3 pass verifies a step
signed with that key as ``crc32c+hmac`` and refuses a forged step (right sizes
and CRC32C, no signature) and a step signed with another key: reported in
``status.storage.foreignSteps`` with a ``ForeignCheckpoint`` Warning, never
deleted by ``keepLast: 1``. A job deleted and re-created with the same name
gets a new Secret with a new key (the old one went with its owner).
"""

import base64
import json
import os
import pathlib
import secrets
import uuid
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import layout, options, remote, s3transport
from tests.integration.devcluster import kube_helpers as kh
from tests.integration.operator.conftest import WAIT, Kube, job_body

pytestmark = pytest.mark.cluster

NAME = "signed"
SECRET = "s3-creds"
READ_KEY = """
import json, os, time
with open(os.environ['CAIRN_MANIFEST_KEYRING']) as f:
    doc = json.load(f)
print('keyring', doc['current'], len(bytes.fromhex(doc['keys'][doc['current']])), flush=True)
time.sleep(600)
"""


def _keyring(kube: Kube) -> tuple[Any, manifest_mod.Keyring]:
    secret = kube.core.read_namespaced_secret(f"{NAME}-manifest-key", kube.namespace)
    raw = base64.b64decode(secret.data["keyring.json"])
    return secret, manifest_mod.parse_keyring(raw)


def _put_step(
    opts: options.S3Options,
    tmp: pathlib.Path,
    step: int,
    *,
    job_uid: str,
    ring: manifest_mod.Keyring | None,
) -> None:
    """A step as the writer uploads it: files, then the manifest (signed with `ring`)."""
    folder = tmp / manifest_mod.step_dir_name(step)
    folder.mkdir(parents=True)
    for name, size in {"__0_0.distcp": 3000, ".metadata": 200}.items():
        (folder / name).write_bytes(os.urandom(size))
    entries = tuple(layout.entry_for(folder, n, rank=0) for n in ("__0_0.distcp", ".metadata"))
    record = manifest_mod.Manifest(
        step=step, world_size=1, attempt=1, created_at=0.0, files=entries, job_uid=job_uid
    )
    if ring is not None:
        record = manifest_mod.sign(record, ring)
    s3 = s3transport.make_client(opts)
    remote.upload_files(s3, opts, folder=folder, manifest=record, entries=entries)
    remote.put_manifest(s3, opts, record)


def _keys(s3: Any, bucket: str, prefix: str) -> set[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {obj["Key"] for page in pages for obj in page.get("Contents", [])}


def test_manifest_key_secret_mounts_and_signed_verification(
    kube: Kube, tmp_path: pathlib.Path
) -> None:
    creds = kube.handle.s3_credentials
    bucket = f"mkey-{uuid.uuid4().hex[:10]}"
    opts = options.S3Options(
        uri=f"s3://{bucket}/runs/{NAME}",
        endpoint_url=kube.handle.s3_endpoint,
        region="us-east-1",
        access_key=creds.access_key,
        secret_key=creds.secret_key,
    )
    s3: Any = s3transport.make_client(opts)
    s3.create_bucket(Bucket=bucket)
    kube.core.create_namespaced_secret(
        kube.namespace,
        kh.s3_secret(SECRET, access_key=creds.access_key, secret_key=creds.secret_key),
    )
    try:
        _run(kube, tmp_path, opts=opts, s3=s3, bucket=bucket)
    finally:
        for key in _keys(s3, bucket, ""):
            s3.delete_object(Bucket=bucket, Key=key)
        s3.delete_bucket(Bucket=bucket)


def _run(
    kube: Kube, tmp_path: pathlib.Path, *, opts: options.S3Options, s3: Any, bucket: str
) -> None:
    body = job_body(
        NAME,
        script=READ_KEY,
        checkpoint={
            "upload": {
                "uri": opts.uri,
                "endpoint": kube.handle.s3_pod_endpoint,
                "credentialsSecretRef": {"name": SECRET},
            },
            "retention": {"remote": {"keepLast": 1}},
        },
    )
    job = kube.create(body)
    uid = job["metadata"]["uid"]
    kube.wait_phase(NAME, "Running", attempt=1)

    secret, ring = _keyring(kube)
    (ref,) = secret.metadata.owner_references
    assert (ref.kind, ref.name, ref.uid, ref.controller) == ("TrainingJob", NAME, uid, True)
    assert ring.current == "k1" and len(ring.keys["k1"]) == 32
    key_hex = ring.keys["k1"].hex()
    for pod in kube.pods(NAME, attempt=1):
        (container,) = pod.spec.containers
        mounts = [m for m in container.volume_mounts if m.name == "cairn-manifest-key"]
        assert [(m.mount_path, m.read_only) for m in mounts] == [
            ("/var/run/cairn/manifest-key", True)
        ]
        (volume,) = [v for v in pod.spec.volumes if v.name == "cairn-manifest-key"]
        assert volume.secret.secret_name == f"{NAME}-manifest-key"
        env = {e.name: e.value for e in container.env}
        assert env["CAIRN_MANIFEST_KEYRING"] == "/var/run/cairn/manifest-key/keyring.json"
        spec_text = json.dumps(kube.api_client.sanitize_for_serialization(pod))
        assert key_hex not in spec_text
        name = pod.metadata.name

        def read_its_key(name: str = name) -> bool:
            return "keyring k1 32" in kh.pod_log(kube.core, name, kube.namespace)

        kh.wait_for(read_its_key, timeout=WAIT, what=f"{name} to read its key")

    # The operator's S3 pass: one genuine step, one forged, one signed by another key.
    other = manifest_mod.Keyring(current="k1", keys={"k1": secrets.token_bytes(32)})
    _put_step(opts, tmp_path, 10, job_uid=uid, ring=ring)
    _put_step(opts, tmp_path, 20, job_uid=uid, ring=None)
    _put_step(opts, tmp_path, 30, job_uid=uid, ring=other)
    planted = _keys(s3, bucket, f"runs/{NAME}/step-")
    kube.custom.patch_namespaced_custom_object_status(
        "cairn.dev",
        "v1alpha1",
        kube.namespace,
        "trainingjobs",
        NAME,
        {"status": {"checkpoints": {"lastUploaded": {"step": 30, "uri": opts.uri}}}},
        field_manager="test-writer",
    )
    storage = kube.wait_status(
        NAME,
        "signed verification and foreign steps",
        lambda s: (
            (s.get("storage") or {}).get("foreignSteps") == [20, 30]
            and (s.get("storage") or {}).get("verifiedStep") == 10
        ),
    )["storage"]
    assert storage["verifiedBy"] == "crc32c+hmac"
    assert "corruptSteps" not in storage
    assert 20 in storage["remoteSteps"] and 30 in storage["remoteSteps"]
    foreign = kube.wait_event(NAME, "ForeignCheckpoint", contains="step 20")
    assert foreign.type == "Warning" and "not signed" in foreign.message
    kube.wait_event(NAME, "ForeignCheckpoint", contains="step 30")
    assert _keys(s3, bucket, f"runs/{NAME}/step-") == planted  # nothing deleted
    everything = json.dumps(kube.job(NAME)) + json.dumps(
        [kube.api_client.sanitize_for_serialization(e) for e in kube.events(NAME)]
    )
    assert key_hex not in everything

    # Re-created with the same name: the old Secret goes with its owner; a new key.
    kube.custom.delete_namespaced_custom_object(
        "cairn.dev", "v1alpha1", kube.namespace, "trainingjobs", NAME
    )

    def secret_gone() -> bool:
        try:
            kube.core.read_namespaced_secret(f"{NAME}-manifest-key", kube.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    kh.wait_for(secret_gone, timeout=WAIT, what="the old job's Secret to be collected")
    again = kube.create(body)
    kube.wait_phase(NAME, "Running", attempt=1)
    secret2, ring2 = _keyring(kube)
    assert secret2.metadata.owner_references[0].uid == again["metadata"]["uid"] != uid
    assert ring2.keys["k1"] != ring.keys["k1"]
