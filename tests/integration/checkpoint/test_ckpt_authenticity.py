"""Authenticated manifests end to end (issue #19): only this job's signed steps count.

Real files, real gloo ranks (`ckpt_harness` + `ckpt_worker`), the real S3
server (SeaweedFS). Covers:

- forged steps planted as newer steps on the shared volume AND in the S3
  prefix (an unsigned manifest with the right sizes and CRC32C; a manifest
  copied from another job, validly signed with that job's key): the job
  resumes from its newest authentic step, reports every planted S3 copy as
  skipped (`restore_fallback`, with the reason), keeps every planted byte
  (never rotated, never deleted, never uploaded), and signs its own new
  steps; the operator's S3 plan over the same prefix verifies the genuine
  steps as `crc32c+hmac`, refuses the planted ones as foreign, and its
  retention never deletes them;
- an explicit `resume.step` naming a forged step is a ConfigurationError
  with the reason; `latest` skips it;
- key rotation (in one process, real files): steps signed with an older key
  id still load after the keyring gained a new current key, and new steps
  carry the new key id;
- a re-created job (new UID, new key) on the same volume does not take the
  old job's steps as its own: it starts fresh, keeps them, and moves the one
  in its way aside;
- the keyring file named by the pod env configures signing; a missing or
  malformed one fails the start with the variable named.
"""

from __future__ import annotations

import json
import pathlib
import secrets
import shutil
import typing

import ckpt_harness  # type: ignore[import-not-found]
import pytest
import torch

from cairn.api import checkpointspec
from cairn.api import manifest as manifest_mod
from cairn.checkpoint import errors, layout, manager, options, remote, s3transport, state
from cairn.operator import s3observe
from cairn.operator.core import s3plan

pytestmark = [
    pytest.mark.torch,
    pytest.mark.filterwarnings(
        "ignore:torch.distributed is disabled:UserWarning",
        "ignore:torch.distributed is unavailable:UserWarning",
    ),
]

UID = "a0a0a0a0-0000-4000-8000-00000000000a"
OTHER_UID = "0b0b0b0b-0000-4000-8000-00000000000b"
RING = manifest_mod.Keyring(current="k1", keys={"k1": secrets.token_bytes(32)})
OTHER_RING = manifest_mod.Keyring(current="k1", keys={"k1": secrets.token_bytes(32)})


def ring_text(ring: manifest_mod.Keyring) -> str:
    return manifest_mod.dump_keyring(ring).decode()


def snapshot(folder: pathlib.Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def forged_from(
    genuine: manifest_mod.Manifest, *, step: int, ring: manifest_mod.Keyring | None, uid: str
) -> manifest_mod.Manifest:
    """The genuine manifest moved to `step` (same files: right sizes and CRC32C),
    re-signed with `ring` (another job's key) or left unsigned."""
    moved = genuine.model_copy(update={"step": step, "job_uid": uid, "signature": None})
    return moved if ring is None else manifest_mod.sign(moved, ring)


def plant_local(root: pathlib.Path, *, source: int, forged: manifest_mod.Manifest) -> None:
    target = layout.step_dir(root, forged.step)
    shutil.copytree(layout.step_dir(root, source), target)
    (target / manifest_mod.MANIFEST_NAME).write_bytes(manifest_mod.dump_manifest(forged))


def plant_remote(
    client: typing.Any, s3opts: options.S3Options, *, source: int, forged: manifest_mod.Manifest
) -> None:
    src = remote.step_prefix(s3opts, source)
    dst = remote.step_prefix(s3opts, forged.step)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=s3opts.bucket, Prefix=src + "/")
    for page in pages:
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(src) + 1 :]
            if rel == manifest_mod.MANIFEST_NAME:
                continue
            body = client.get_object(Bucket=s3opts.bucket, Key=obj["Key"])["Body"].read()
            client.put_object(Bucket=s3opts.bucket, Key=f"{dst}/{rel}", Body=body)
    client.put_object(
        Bucket=s3opts.bucket,
        Key=f"{dst}/{manifest_mod.MANIFEST_NAME}",
        Body=manifest_mod.dump_manifest(forged),
    )


def objects_under(client: typing.Any, bucket: str, prefix: str) -> dict[str, bytes]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    keys = [obj["Key"] for page in pages for obj in page.get("Contents", [])]
    return {k: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


@pytest.mark.s3
def test_forged_and_copied_steps_are_foreign_kept_and_the_job_resumes_its_own(
    tmp_path: pathlib.Path, s3_server: typing.Any
) -> None:
    bucket = s3_server.new_bucket("auth-forged")
    s3 = ckpt_harness.s3_cfg(s3_server, bucket, prefix="jobs/auth")
    s3opts = options.S3Options(**s3)
    client = s3transport.make_client(s3opts)
    ckpt = tmp_path / "ckpt"
    base: dict[str, typing.Any] = {
        "dir": str(ckpt),
        "interval": 2,
        "keep_last": 2,
        "job_uid": UID,
        "keyring": ring_text(RING),
        "s3": s3,
    }
    ckpt_harness.launch({**base, "steps": 4}, world=2, tmp=tmp_path, name="first").wait()
    assert remote.committed_steps(client, s3opts) == [2, 4]
    genuine = layout.read_manifest(layout.step_dir(ckpt, 4))
    assert genuine.signature is not None and genuine.signature.key_id == "k1"

    unsigned = forged_from(genuine, step=100, ring=None, uid=UID)  # no signature at all
    copied = forged_from(genuine, step=102, ring=OTHER_RING, uid=OTHER_UID)  # another job's
    for forged in (unsigned, copied):
        plant_local(ckpt, source=4, forged=forged)
        plant_remote(client, s3opts, source=4, forged=forged)
        assert layout.verify_files(layout.step_dir(ckpt, forged.step), forged.files) == []
        assert layout.classify(layout.step_dir(ckpt, forged.step), job_uid=UID, keyring=RING) == (
            "foreign"
        )
    planted_local = {n: snapshot(layout.step_dir(ckpt, n)) for n in (100, 102)}
    planted_remote = {
        n: objects_under(client, bucket, remote.step_prefix(s3opts, n) + "/") for n in (100, 102)
    }

    resumed = ckpt_harness.launch(
        {**base, "steps": 8, "resume": True, "attempt": 1}, world=2, tmp=tmp_path, name="resumed"
    )
    resumed.wait()
    for rank in range(2):
        result = resumed.result(rank)
        assert result["restored"] == 4  # the newest AUTHENTIC step
        assert result["skipped"] == [102, 100]  # their S3 copies: tried, refused, reported
    fallbacks = {
        e["step"]: e["message"]
        for e in resumed.result(0)["events"]
        if e["phase"] == "restore_fallback"
    }
    assert "foreign" in fallbacks[100] and "not signed" in fallbacks[100]
    assert "foreign" in fallbacks[102] and "does not verify" in fallbacks[102]
    # Kept byte for byte, locally and in S3: never rotated, deleted or overwritten.
    for n in (100, 102):
        assert snapshot(layout.step_dir(ckpt, n)) == planted_local[n]
        assert (
            objects_under(client, bucket, remote.step_prefix(s3opts, n) + "/")
            == (planted_remote[n])
        )
    assert layout.committed_steps(ckpt, job_uid=UID, keyring=RING) == [6, 8]  # rotation ran
    for n in (6, 8):
        mine = layout.read_manifest(layout.step_dir(ckpt, n))
        assert manifest_mod.authenticate(mine, job_uid=UID, keyring=RING).own

    # The operator's S3 pass over the same prefix (real listing, heads and reads).
    seen = s3observe.observe(s3_server.client(), s3observe.Target.parse(s3opts.uri))
    todo = s3plan.plan(
        listing=seen.listing,
        manifests=seen.manifests,
        remote=checkpointspec.RemoteRetention(keep_last=1),
        job_uid=UID,
        keyring=RING,
    )
    assert todo.newest_verified is not None
    assert (todo.newest_verified.step, todo.newest_verified.method) == (8, "crc32c+hmac")
    assert [(v.step, v.foreign) for v in todo.failed] == [(100, True), (102, True)]
    assert not {100, 102} & set(todo.deleted_steps)
    assert {100, 102} <= set(todo.kept)


class _Small:
    """A model + AdamW + step counter in one process (no process group)."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(4, 2)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.train = state.TrainState()
        self.objects: dict[str, state.Stateful] = {
            "model": state.ModelOptimizerState(self.model, self.optim),
            "train": self.train,
        }


def _opts(
    root: pathlib.Path, *, keyring: manifest_mod.Keyring = RING, **kw: typing.Any
) -> options.CheckpointOptions:
    return options.CheckpointOptions(directory=root, job_uid=UID, manifest_keyring=keyring, **kw)


def test_an_explicit_step_that_does_not_authenticate_is_a_configuration_error(
    tmp_path: pathlib.Path,
) -> None:
    with manager.CheckpointManager(_opts(tmp_path)) as m:
        m.save(5, _Small(seed=1).objects, force=True)
    genuine = layout.read_manifest(layout.step_dir(tmp_path, 5))
    plant_local(tmp_path, source=5, forged=forged_from(genuine, step=7, ring=None, uid=UID))
    before = snapshot(layout.step_dir(tmp_path, 7))
    with (
        manager.CheckpointManager(_opts(tmp_path, attempt=1)) as m,
        pytest.raises(errors.ConfigurationError, match=r"not this job's own.*not signed"),
    ):
        m.restore(_Small(seed=2).objects, step=7)
    with manager.CheckpointManager(_opts(tmp_path, attempt=2)) as m:
        restored = m.restore(_Small(seed=3).objects)
        assert restored is not None and restored.step == 5  # latest skips it
        assert m.all_steps() == [5]
    assert snapshot(layout.step_dir(tmp_path, 7)) == before


def test_steps_signed_with_an_older_key_id_still_load_after_rotation(
    tmp_path: pathlib.Path,
) -> None:
    with manager.CheckpointManager(_opts(tmp_path, keep_last=5)) as m:
        for step in (2, 4):
            m.save(step, _Small(seed=step).objects, force=True)
    rotated = manifest_mod.rotated(RING, key_id="k2", key=secrets.token_bytes(32))
    with manager.CheckpointManager(_opts(tmp_path, keep_last=5, attempt=1, keyring=rotated)) as m:
        restored = m.restore(_Small(seed=9).objects)
        assert restored is not None and restored.step == 4  # signed with k1
        m.save(6, _Small(seed=6).objects, force=True)
        m.wait_until_finished()
        assert m.all_steps() == [2, 4, 6]
    key_ids = {}
    for n in (2, 4, 6):
        found = layout.read_manifest(layout.step_dir(tmp_path, n))
        assert found.signature is not None
        key_ids[n] = found.signature.key_id
        assert manifest_mod.authenticate(found, job_uid=UID, keyring=rotated).own
    assert key_ids == {2: "k1", 4: "k1", 6: "k2"}
    # A reader the rotation did not reach cannot take the new key's step.
    assert layout.committed_steps(tmp_path, job_uid=UID, keyring=RING) == [2, 4]


def test_a_recreated_job_does_not_take_the_old_jobs_steps(tmp_path: pathlib.Path) -> None:
    with manager.CheckpointManager(_opts(tmp_path, keep_last=2)) as m:
        for step in (2, 4):
            m.save(step, _Small(seed=step).objects, force=True)
    old = {n: snapshot(layout.step_dir(tmp_path, n)) for n in (2, 4)}
    # Same name, new UID: the operator made a new Secret, so a new key (same id "k1").
    new_ring = manifest_mod.Keyring(current="k1", keys={"k1": secrets.token_bytes(32)})
    recreated = options.CheckpointOptions(
        directory=tmp_path, job_uid=OTHER_UID, manifest_keyring=new_ring, keep_last=2
    )
    with manager.CheckpointManager(recreated) as m:
        assert m.restore(_Small(seed=9).objects) is None  # fresh start, no error
        m.save(2, _Small(seed=5).objects, force=True)
        m.wait_until_finished()
        assert m.all_steps() == [2]
    # The old job's steps are kept: step 4 where it was, step 2 (in the way of
    # the new job's step 2) moved aside under .cairn/foreign/<old uid8>/.
    assert snapshot(layout.step_dir(tmp_path, 4)) == old[4]
    aside_2 = tmp_path / ".cairn" / "foreign" / UID[:8] / manifest_mod.step_dir_name(2)
    assert snapshot(aside_2) == old[2]
    found = layout.read_manifest(layout.step_dir(tmp_path, 4))
    assert "does not verify" in manifest_mod.verify(found, new_ring).reason


def test_the_keyring_file_from_the_pod_env_configures_signing(tmp_path: pathlib.Path) -> None:
    from cairn.api import podenv
    from cairn.checkpoint import runtime_config

    keyfile = tmp_path / "keyring.json"
    keyfile.write_bytes(manifest_mod.dump_keyring(RING))
    cfg = runtime_config.from_env({podenv.MANIFEST_KEYRING: str(keyfile), podenv.JOB_UID: UID})
    assert cfg.checkpoint.manifest_keyring == RING
    assert runtime_config.from_env({}).checkpoint.manifest_keyring is None
    keyfile.write_text(json.dumps({"current": "k9", "keys": {}}))
    with pytest.raises(ValueError, match=podenv.MANIFEST_KEYRING):
        runtime_config.from_env({podenv.MANIFEST_KEYRING: str(keyfile)})
    with pytest.raises(ValueError, match="No such file"):
        runtime_config.from_env({podenv.MANIFEST_KEYRING: str(tmp_path / "absent")})
