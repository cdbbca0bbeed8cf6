"""Edges of the commit side: what start-up keeps, lineage, zombies, re-created jobs, fencing.

Real files, real gloo ranks (`ckpt_harness` + `ckpt_worker`), the real S3
server (SeaweedFS) and the devcluster's kube-apiserver. Covers:

- a step with a newer-format manifest and a plain DCP folder (`.metadata` +
  `__0_0.distcp`, no manifest, named step-000000007) survive a manager's
  start-up, its saves and rotation byte for byte, and a resume ignores them;
- rollback: resuming from an older step then saving 3 more keeps the new
  lineage's steps (the old run's newer steps are moved aside, locally and in
  S3, never deleted), and a later resume picks the new lineage's newest;
- a rollback on node-local volumes killed between its local and its S3
  supersede: the next attempt on EMPTY volumes finishes the branch from the
  S3 record and resumes the branch point, not the old lineage's newer step;
- saving a step at or below the lineage's latest committed step raises;
- a zombie writer of attempt k, held at a pause point, keeps writing and
  uploading after attempt k+1 committed the same step numbers: no byte of
  k+1's committed files or objects changes (CRC32C), the zombie's remote
  commit is refused;
- a re-created job (new UID, lower attempt) on an old volume starts cleanly,
  never loads the old job's steps as its own and never deletes them;
- the API fence against the real API server refuses a stale attempt, a
  re-created job and a deleted job;
- uploads carry the manifest's whole-file CRC32C: the operator verifies
  attempt-scoped multipart objects by CRC (not size), and the server refuses
  bytes that do not match.
"""

from __future__ import annotations

import json
import pathlib
import typing
import uuid
from collections.abc import Iterator

import ckpt_harness  # type: ignore[import-not-found]
import pytest
import torch
from kubernetes import client
from torch.distributed.checkpoint import state_dict_saver

from cairn.api import manifest as manifest_mod
from cairn.api import trainingjob
from cairn.checkpoint import (
    errors,
    fence,
    layout,
    lineage,
    manager,
    options,
    remote,
    s3transport,
    state,
    status_reporter,
)
from cairn.operator import s3observe
from cairn.operator.core import s3plan
from tests import demo
from tests.conftest import DevclusterHandle
from tests.integration.devcluster import kube_helpers

pytestmark = [
    pytest.mark.torch,
    pytest.mark.filterwarnings(
        "ignore:torch.distributed is disabled:UserWarning",
        "ignore:torch.distributed is unavailable:UserWarning",
    ),
]

UID_A = "aaaaaaaa-0000-4000-8000-000000000001"
UID_B = "bbbbbbbb-0000-4000-8000-000000000002"
NOT_CAIRN = "example.com/not-cairn"
"""spec.managedBy of jobs this module plays the operator for (the shared one leaves them alone)."""


def crcs(root: pathlib.Path) -> dict[str, str]:
    """CRC32C of every regular file under root, by relative path."""
    return {
        str(p.relative_to(root)): layout.file_crc32c(p)[1]
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def object_crcs(server: typing.Any, bucket: str, prefix: str) -> dict[str, str]:
    """Server-side full-object CRC32C (or the ETag for composite ones) of every key."""
    client = server.client()
    found: dict[str, str] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            head = client.head_object(Bucket=bucket, Key=obj["Key"], ChecksumMode="ENABLED")
            found[obj["Key"]] = str(head.get("ChecksumCRC32C") or head["ETag"])
    return found


def manifest_doc(**fields: typing.Any) -> bytes:
    doc = {
        "step": 5,
        "world_size": 1,
        "attempt": 0,
        "created_at": 0.0,
        "files": [{"path": "__0_0.distcp", "size": 4, "crc32c": "00000000", "rank": 0}],
        **fields,
    }
    return json.dumps(doc).encode()


def test_newer_manifest_and_foreign_dcp_folder_survive_start_up(tmp_path: pathlib.Path) -> None:
    ckpt = tmp_path / "ckpt"
    newer = layout.step_dir(ckpt, 5)
    newer.mkdir(parents=True)
    (newer / "manifest.json").write_bytes(manifest_doc(format_version=2, shards={"new": True}))
    (newer / "__0_0.distcp").write_bytes(b"data")
    plain = layout.step_dir(ckpt, 7)
    state_dict_saver.save({"w": torch.arange(8.0)}, checkpoint_id=plain, no_dist=True)
    assert {p.name for p in plain.iterdir()} >= {".metadata", "__0_0.distcp"}
    assert layout.classify(newer, job_uid=UID_A) == "unreadable"
    assert layout.classify(plain, job_uid=UID_A) == "foreign"
    before = crcs(ckpt)

    cfg = {"dir": str(ckpt), "interval": 2, "keep_last": 2, "steps": 6, "job_uid": UID_A}
    ckpt_harness.launch(cfg, world=2, tmp=tmp_path, name="first").wait()
    after = crcs(ckpt)
    assert {k: after.get(k) for k in before} == before  # every byte kept
    assert layout.committed_steps(ckpt, job_uid=UID_A) == [4, 6]  # rotation did run

    resumed = ckpt_harness.launch(
        {**cfg, "steps": 8, "resume": True, "attempt": 1}, world=2, tmp=tmp_path, name="resumed"
    )
    resumed.wait()
    assert resumed.result(0)["restored"] == 6
    after = crcs(ckpt)
    assert {k: after.get(k) for k in before} == before


def test_rollback_then_three_saves_keeps_the_new_lineage(
    tmp_path: pathlib.Path, s3_server: typing.Any
) -> None:
    bucket = s3_server.new_bucket("edge-rollback")
    ckpt = tmp_path / "ckpt"
    base: dict[str, typing.Any] = {
        "dir": str(ckpt),
        "interval": 2,
        "keep_last": 10,
        "job_uid": UID_A,
        "s3": ckpt_harness.s3_cfg(s3_server, bucket, prefix="jobs/edge"),
    }
    ckpt_harness.launch({**base, "steps": 8}, world=2, tmp=tmp_path, name="old-run").wait()
    old = {s: layout.read_manifest(layout.step_dir(ckpt, s)) for s in (6, 8)}

    rollback = ckpt_harness.launch(
        {**base, "steps": 10, "resume": True, "resume_step": 4, "attempt": 1, "dump_steps": [10]},
        world=2,
        tmp=tmp_path,
        name="rollback",
    )
    rollback.wait()
    assert rollback.result(0)["restored"] == 4
    assert rollback.result(0)["saved"] == [6, 8, 10]  # three more saves, none skipped

    new_lineage = f"{UID_A[:8]}-a1"
    old_lineage = f"{UID_A[:8]}-a0"
    assert layout.committed_steps(ckpt, job_uid=UID_A) == [2, 4, 6, 8, 10]
    for step in (6, 8, 10):
        assert layout.read_manifest(layout.step_dir(ckpt, step)).lineage == new_lineage
    first = layout.read_manifest(layout.step_dir(ckpt, 6))
    assert first.parent == manifest_mod.Parent(step=4, lineage=old_lineage)
    # The old run's newer steps moved aside, never deleted (locally and in S3).
    for step, manifest in old.items():
        aside = ckpt / ".cairn" / "superseded" / old_lineage / manifest_mod.step_dir_name(step)
        assert layout.read_manifest(aside) == manifest
        assert layout.verify_files(aside, manifest.files) == []
        key = f"jobs/edge/.cairn/superseded/{old_lineage}/{manifest_mod.step_dir_name(step)}"
        body = s3_server.client().get_object(Bucket=bucket, Key=f"{key}/manifest.json")
        assert manifest_mod.parse_manifest(body["Body"].read()) == manifest
    s3opts = options.S3Options(**base["s3"])
    client = s3transport.make_client(s3opts)
    assert remote.committed_steps(client, s3opts) == [2, 4, 6, 8, 10]

    later = ckpt_harness.launch(
        {**base, "steps": 12, "resume": True, "attempt": 2}, world=2, tmp=tmp_path, name="later"
    )
    later.wait()
    assert later.result(0)["restored"] == 10  # the new lineage, not the old run's 8
    for rank in range(2):
        before, after = rollback.dump(10, rank), later.dump("restored", rank)
        for key, value in before["model"].items():
            assert torch.equal(value, after["model"][key]), key
        assert before["data"] == after["data"]


@pytest.mark.s3
def test_crash_between_local_and_remote_supersede_then_empty_volume_resumes_the_branch(
    tmp_path: pathlib.Path, s3_server: typing.Any
) -> None:
    """Node-local volumes: the rollback's rank 0 dies after moving the old
    lineage's steps aside on its volume but before moving them in S3; the
    next attempt starts on EMPTY volumes (new pods) and must resume the
    branch point, not the old lineage's newer step still listed in S3."""
    bucket = s3_server.new_bucket("edge-branch-crash")
    s3 = ckpt_harness.s3_cfg(s3_server, bucket, prefix="jobs/edge")
    s3opts = options.S3Options(**s3)
    client = s3transport.make_client(s3opts)
    base: dict[str, typing.Any] = {"interval": 2, "keep_last": 10, "job_uid": UID_A, "s3": s3}
    ckpt_harness.launch(
        {**base, "dir": str(tmp_path / "pods-a0-{rank}"), "steps": 8},
        world=2,
        tmp=tmp_path,
        name="old-run",
    ).wait()
    assert remote.committed_steps(client, s3opts) == [2, 4, 6, 8]

    crashed = ckpt_harness.launch(
        {
            **base,
            "dir": str(tmp_path / "pods-a1-{rank}"),
            "steps": 10,
            "resume": True,
            "resume_step": 4,
            "attempt": 1,
        },
        world=2,
        tmp=tmp_path,
        name="rollback",
        env={
            "CAIRN_CKPT_FAULT": "supersede:0:4",
            "CAIRN_CKPT_FAULT_DIR": str(tmp_path),
            "CAIRN_CKPT_FAULT_SLEEP": "120",
        },
    )
    ckpt_harness.wait_for_file(tmp_path / "supersede-0-4", job=crashed)
    ckpt_harness.sigkill(crashed, 0)
    crashed.kill()
    # The window: the branch record is in S3, S3 still lists the old lineage.
    assert remote.committed_steps(client, s3opts) == [2, 4, 6, 8]
    record = lineage.read_remote_record(client, s3opts)
    assert record is not None and record["pending"]["supersede"] == [6, 8]

    restarted = ckpt_harness.launch(
        {**base, "dir": str(tmp_path / "pods-a2-{rank}"), "steps": 6, "resume": True, "attempt": 2},
        world=2,
        tmp=tmp_path,
        name="restarted",
    )
    restarted.wait()
    for rank in range(2):
        assert restarted.result(rank)["restored"] == 4  # not the old lineage's 8
    assert restarted.result(0)["saved"] == [6]  # the branch goes on at 6
    assert lineage.read_remote_record(client, s3opts) is None
    assert remote.committed_steps(client, s3opts) == [2, 4, 6]
    old_lineage = f"{UID_A[:8]}-a0"
    for step in (6, 8):  # moved aside in S3, never deleted
        key = f"jobs/edge/.cairn/superseded/{old_lineage}/{manifest_mod.step_dir_name(step)}"
        body = client.get_object(Bucket=bucket, Key=f"{key}/manifest.json")["Body"].read()
        assert manifest_mod.parse_manifest(body).attempt == 0


class _Tiny:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 2)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.train = state.TrainState()
        self.objects: dict[str, state.Stateful] = {
            "model_optim": state.ModelOptimizerState(self.model, self.optim),
            "train": self.train,
        }

    def step(self) -> None:
        self.model(torch.randn(3, 4)).square().mean().backward()
        self.optim.step()
        self.optim.zero_grad()
        self.train.step += 1


def test_save_at_or_below_the_lineage_latest_raises(tmp_path: pathlib.Path) -> None:
    tiny = _Tiny()
    opts = options.CheckpointOptions(directory=tmp_path, job_uid=UID_A, async_mode="off")
    with manager.CheckpointManager(opts) as ckpt:
        for step in (1, 2, 3):
            tiny.step()
            assert ckpt.save(step, tiny.objects, force=True)
        with pytest.raises(errors.CheckpointError, match="lineage"):
            ckpt.save(3, tiny.objects, force=True)
    with manager.CheckpointManager(
        options.CheckpointOptions(directory=tmp_path, job_uid=UID_A, attempt=1)
    ) as ckpt:
        restored = ckpt.restore(tiny.objects)
        assert restored is not None and restored.step == 3
        for step in (2, 3):
            with pytest.raises(errors.CheckpointError, match="already committed in lineage"):
                ckpt.save(step, tiny.objects, force=True)
        assert ckpt.save(4, tiny.objects, force=True)
    assert layout.committed_steps(tmp_path, job_uid=UID_A) == [2, 3, 4]  # keep_last 3


@pytest.mark.s3
def test_zombie_writer_never_changes_committed_bytes(
    tmp_path: pathlib.Path, s3_server: typing.Any
) -> None:
    bucket = s3_server.new_bucket("edge-zombie")
    s3 = ckpt_harness.s3_cfg(s3_server, bucket, prefix="jobs/edge")
    base = {"interval": 2, "keep_last": 10, "steps": 6, "job_uid": UID_A, "s3": s3}
    # Attempt 0 on its pods' node-local volumes; held after writing step 4.
    zombie = ckpt_harness.launch(
        {**base, "dir": str(tmp_path / "old-pod-{rank}"), "timeout": 300},
        world=2,
        tmp=tmp_path,
        name="zombie",
        env={
            "CAIRN_CKPT_FAULT": "write:0:4",
            "CAIRN_CKPT_FAULT_DIR": str(tmp_path),
            "CAIRN_CKPT_FAULT_SLEEP": "300",
        },
    )
    held = tmp_path / "write-0-4"
    ckpt_harness.wait_for_file(held, job=zombie)

    # Attempt 1 on new pods (fresh volumes), same bucket: resumes step 2 from
    # S3 and commits steps 4 and 6 while the zombie is still alive.
    new = ckpt_harness.launch(
        {**base, "dir": str(tmp_path / "new-pod-{rank}"), "resume": True, "attempt": 1},
        world=2,
        tmp=tmp_path,
        name="attempt-1",
    )
    new.wait()
    assert new.result(0)["restored"] == 2
    committed_files = {r: crcs(tmp_path / f"new-pod-{r}") for r in range(2)}
    committed_objects = object_crcs(s3_server, bucket, "jobs/edge/")
    manifest4 = remote.get_bytes_or_none(
        s3_server.client(), bucket, "jobs/edge/step-000000004/manifest.json"
    )
    assert manifest4 is not None and manifest_mod.parse_manifest(manifest4).attempt == 1

    # Let the zombie go on: it commits on its own old volume, uploads its
    # files (to its own attempt-scoped keys), and its remote commit is refused.
    held.with_name("write-0-4.release").write_text("")
    with pytest.raises(AssertionError, match="exited"):
        zombie.wait(timeout=120)
    assert "FencedError" in zombie.tail()
    zombie_keys = set(object_crcs(s3_server, bucket, "jobs/edge/step-000000004/a0-"))
    assert zombie_keys, "the zombie did upload (to attempt 0's keys)"

    assert {r: crcs(tmp_path / f"new-pod-{r}") for r in range(2)} == committed_files
    now = object_crcs(s3_server, bucket, "jobs/edge/")
    assert {k: now.get(k) for k in committed_objects} == committed_objects
    assert (
        remote.get_bytes_or_none(
            s3_server.client(), bucket, "jobs/edge/step-000000004/manifest.json"
        )
        == manifest4
    )


def test_recreated_job_on_an_old_volume_starts_cleanly(tmp_path: pathlib.Path) -> None:
    ckpt = tmp_path / "ckpt"
    cfg = {"dir": str(ckpt), "interval": 2, "keep_last": 2, "job_uid": UID_A}
    ckpt_harness.launch(
        {**cfg, "steps": 6, "attempt": 3}, world=2, tmp=tmp_path, name="old-job"
    ).wait()
    old_steps = {s: crcs(layout.step_dir(ckpt, s)) for s in (4, 6)}

    recreated = ckpt_harness.launch(
        {**cfg, "job_uid": UID_B, "steps": 4, "attempt": 0, "resume": True},
        world=2,
        tmp=tmp_path,
        name="new-job",
    )
    recreated.wait()
    assert recreated.result(0)["restored"] is None  # the old job's steps are not ours
    assert layout.committed_steps(ckpt, job_uid=UID_B) == [2, 4]
    assert fence.read_record(ckpt) == fence.FenceRecord(job_uid=UID_B, attempt=0)
    # Step 4 collided and was moved aside; step 6 never collided and stays put.
    assert crcs(ckpt / ".cairn" / "foreign" / UID_A[:8] / "step-000000004") == old_steps[4]
    assert crcs(layout.step_dir(ckpt, 6)) == old_steps[6]
    assert layout.classify(layout.step_dir(ckpt, 6), job_uid=UID_B) == "foreign"


@pytest.fixture
def namespace(devcluster: DevclusterHandle) -> Iterator[str]:
    yield from kube_helpers.temp_namespace(devcluster.core, "fence")


def _fenced_job(custom: client.CustomObjectsApi, namespace: str) -> str:
    """A TrainingJob that another controller manages; its UID.

    The test plays the operator (it sets `status.attempt` itself), so the
    devcluster's shared Cairn operator must not reconcile the job and write its
    own attempt back between the test's patch and the fence check: with
    `spec.managedBy` naming another controller it leaves the job alone.
    """
    group, version = trainingjob.API_VERSION.split("/")
    body = {
        "apiVersion": trainingjob.API_VERSION,
        "kind": "TrainingJob",
        "metadata": {"name": "fenced"},
        "spec": {
            "suspend": True,
            "nodes": 1,
            "image": "cairn-trainer:dev",
            "managedBy": NOT_CAIRN,
        },
    }
    created = custom.create_namespaced_custom_object(
        group, version, namespace, trainingjob.PLURAL, body
    )
    return str(created["metadata"]["uid"])


def _set_attempt(custom: client.CustomObjectsApi, namespace: str, attempt: int) -> None:
    """What the operator does when it starts an attempt."""
    group, version = trainingjob.API_VERSION.split("/")
    custom.patch_namespaced_custom_object_status(
        group,
        version,
        namespace,
        trainingjob.PLURAL,
        "fenced",
        {"status": {"attempt": attempt}},
        _content_type="application/merge-patch+json",
    )


@pytest.mark.cluster
def test_api_fence_refuses_a_stale_attempt(devcluster: DevclusterHandle, namespace: str) -> None:
    demo.install_crd(devcluster.api_client)
    custom = client.CustomObjectsApi(devcluster.api_client)
    uid = _fenced_job(custom, namespace)
    get_job = status_reporter.job_reader(
        api_client=devcluster.api_client, namespace=namespace, name="fenced"
    )
    current = fence.ApiFence(get_job=get_job, job_uid=uid)
    _set_attempt(custom, namespace, 1)
    current.check(1)
    _set_attempt(custom, namespace, 2)  # attempt 1 is a zombie from now on
    with pytest.raises(errors.FencedError, match="attempt 2"):
        current.check(1)
    current.check(2)
    with pytest.raises(errors.FencedError, match="re-created"):
        fence.ApiFence(get_job=get_job, job_uid=str(uuid.uuid4())).check(2)
    group, version = trainingjob.API_VERSION.split("/")
    custom.delete_namespaced_custom_object(group, version, namespace, trainingjob.PLURAL, "fenced")
    # Gone, or held by the operator's finalizer: refused either way.
    with pytest.raises(errors.FencedError, match=r"being deleted|no longer exists"):
        current.check(2)


@pytest.mark.s3
def test_operator_verifies_attempt_scoped_multipart_objects_by_crc(
    tmp_path: pathlib.Path, s3_server: typing.Any
) -> None:
    bucket = s3_server.new_bucket("edge-verify")
    s3opts = options.S3Options(
        **ckpt_harness.s3_cfg(s3_server, bucket, prefix="jobs/edge"),
        part_size=5 * 1024 * 1024,
        concurrency=2,
    )
    folder = tmp_path / "step"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(torch.randn(3 * 1024 * 1024).numpy().tobytes())
    (folder / ".metadata").write_bytes(b"meta")
    entries = tuple(layout.entry_for(folder, n, rank=0) for n in ("__0_0.distcp", ".metadata"))
    record = manifest_mod.Manifest(
        step=3,
        world_size=1,
        attempt=2,
        created_at=0.0,
        files=entries,
        job_uid=UID_A,
        data_prefix=f"a2-{UID_A[:8]}",
    )
    client = s3transport.make_client(s3opts)
    remote.upload_files(client, s3opts, folder=folder, manifest=record, entries=entries)
    remote.put_manifest(client, s3opts, record)

    target = s3observe.Target.parse(s3opts.uri)
    seen = s3observe.observe(s3_server.client(), target)
    assert set(seen.listing[3]) == {
        "manifest.json",
        f"a2-{UID_A[:8]}/__0_0.distcp",
        f"a2-{UID_A[:8]}/.metadata",
    }
    verdict = s3plan.verify_step(step=3, objects=seen.listing[3], manifest=seen.manifests[3])
    assert (verdict.verified, verdict.method) == (True, "crc32c")  # multipart included

    # A corrupt upload is refused by the server: the bytes do not match the CRC sent.
    (folder / "__0_0.distcp").write_bytes(b"x" * entries[0].size)
    with pytest.raises(errors.RemoteError, match=r"BadDigest|did not match"):
        remote.upload_files(client, s3opts, folder=folder, manifest=record, entries=entries[:1])
