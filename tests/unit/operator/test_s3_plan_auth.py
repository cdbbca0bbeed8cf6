"""The S3 pass's plan checks manifest signatures (s3plan with a keyring; issue #19).

Covers: a step signed with the job's key verifies as ``crc32c+hmac`` (or
``size+hmac`` without a full-object CRC); a forged newer step (correct sizes
and CRC32C, no or a wrong signature) and another job's signed step are
foreign: not verified, never deleted by retention, never the newest verified
step, reported in ``foreignSteps`` with a ``ForeignCheckpoint`` Warning (not
in ``corruptSteps``); without a keyring a manifest without ``job_uid`` is
foreign too; the keyring ``jobapply`` draws for a new Secret holds one fresh
32-byte key (two draws differ) and is never part of the plan's Secret.
Pure: hand-made observations.
"""

import base64
import datetime

from cairn.api import jobstatus
from cairn.api import manifest as manifest_mod
from cairn.operator import jobapply
from cairn.operator.core import builders, s3plan

from . import jobs

OBJ = s3plan.RemoteObject
FILES = {"__0_0.distcp": (100, "0a0b0c0d")}
RING = manifest_mod.Keyring(current="k1", keys={"k1": b"k" * 32})
OTHER_RING = manifest_mod.Keyring(current="k1", keys={"k1": b"o" * 32})
NOW = datetime.datetime(2026, 11, 27, 3, 0, tzinfo=datetime.UTC)


def _manifest(step: int, **fields: object) -> manifest_mod.Manifest:
    return manifest_mod.Manifest(
        step=step,
        world_size=1,
        attempt=1,
        created_at=0.0,
        files=tuple(
            manifest_mod.FileEntry(path=p, size=s, crc32c=c, rank=0) for p, (s, c) in FILES.items()
        ),
        **fields,  # type: ignore[arg-type]
    )


def _observation(
    manifests: dict[int, manifest_mod.Manifest], *, crc: bool = True
) -> s3plan.Observation:
    listing = {
        step: {
            **{p: OBJ(size=s, crc32c=c if crc else None) for p, (s, c) in FILES.items()},
            manifest_mod.MANIFEST_NAME: OBJ(size=300),
        }
        for step in manifests
    }
    return s3plan.Observation(listing=listing, manifests=dict(manifests))


def _plan(
    manifests: dict[int, manifest_mod.Manifest],
    *,
    keyring: manifest_mod.Keyring | None = RING,
    crc: bool = True,
) -> s3plan.RemotePlan:
    checkpoint = {"upload": {"uri": "s3://bucket/run"}, "retention": {"remote": {"keepLast": 1}}}
    return s3plan.plan_job(
        job=jobs.job({}, checkpoint=checkpoint),
        status=jobstatus.TrainingJobStatus(),
        observation=_observation(manifests, crc=crc),
        keyring=keyring,
    )


def _genuine(step: int) -> manifest_mod.Manifest:
    return manifest_mod.sign(_manifest(step, job_uid=jobs.JOB_UID), RING)


def test_a_signed_step_verifies_with_the_signature_in_verified_by() -> None:
    todo = _plan({10: _genuine(10)})
    assert todo.newest_verified is not None
    assert todo.newest_verified.method == "crc32c+hmac"
    size_only = _plan({10: _genuine(10)}, crc=False)
    assert size_only.newest_verified is not None
    assert size_only.newest_verified.method == "size+hmac"


def test_forged_newer_steps_are_foreign_kept_and_never_newest() -> None:
    unsigned = _manifest(40, job_uid=jobs.JOB_UID)  # sizes and CRCs match the objects
    resigned = _genuine(50).model_copy(update={"step": 60})  # a valid MAC moved to another step
    theirs = manifest_mod.sign(_manifest(70, job_uid="uid-other"), OTHER_RING)
    todo = _plan({10: _genuine(10), 20: _genuine(20), 40: unsigned, 60: resigned, 70: theirs})
    assert todo.newest_verified is not None and todo.newest_verified.step == 20
    assert todo.verified_steps == (10, 20)
    assert [(v.step, v.foreign) for v in todo.failed] == [(40, True), (60, True), (70, True)]
    assert todo.deleted_steps == (10,)  # keepLast 1 over the genuine steps only
    assert set(todo.kept) == {20, 40, 60, 70}
    reasons = {v.step: v.reason for v in todo.failed}
    assert reasons[40] == "manifest is not signed"
    assert "does not verify" in reasons[60]
    assert "does not verify" in reasons[70]


def test_foreign_steps_are_reported_apart_from_corrupt_ones() -> None:
    corrupt = manifest_mod.sign(
        _manifest(30, job_uid=jobs.JOB_UID).model_copy(
            update={
                "files": (
                    manifest_mod.FileEntry(
                        path="__0_0.distcp", size=100, crc32c="ffffffff", rank=0
                    ),
                )
            }
        ),
        RING,
    )
    todo = _plan({20: _genuine(20), 30: corrupt, 40: _manifest(40, job_uid=jobs.JOB_UID)})
    patch, events = s3plan.storage_update(
        previous=None, result=todo, deleted=(), error=None, now=NOW
    )
    assert patch is not None
    assert patch["verifiedBy"] == "crc32c+hmac"
    assert patch["corruptSteps"] == [30]
    assert patch["foreignSteps"] == [40]
    reasons = [(e.type, e.reason) for e in events]
    assert ("Warning", "ForeignCheckpoint") in reasons
    assert ("Warning", "VerificationFailed") in reasons
    foreign_event = next(e for e in events if e.reason == "ForeignCheckpoint")
    assert "step 40" in foreign_event.message and "not signed" in foreign_event.message
    # Reported once: the next pass with the same finding posts nothing new.
    before = jobstatus.StorageStatus.model_validate(patch)
    _, again = s3plan.storage_update(previous=before, result=todo, deleted=(), error=None, now=NOW)
    assert [e.reason for e in again if e.type == "Warning"] == []


def test_without_a_keyring_a_manifest_without_job_uid_is_foreign() -> None:
    todo = _plan({10: _manifest(10, job_uid=jobs.JOB_UID), 20: _manifest(20)}, keyring=None)
    assert todo.verified_steps == (10,)
    assert todo.newest_verified is not None and todo.newest_verified.method == "crc32c"
    assert [(v.step, v.foreign) for v in todo.failed] == [(20, True)]


def test_effects_draws_a_fresh_key_only_for_the_create() -> None:
    job = jobs.job({})
    planned = builders.manifest_key_secret(job)
    assert "data" not in planned  # the plan never carries a key
    first = jobapply._with_fresh_keyring(planned)
    second = jobapply._with_fresh_keyring(planned)
    rings = [
        manifest_mod.parse_keyring(base64.b64decode(s["data"]["keyring.json"]))
        for s in (first, second)
    ]
    assert [r.current for r in rings] == ["k1", "k1"]
    assert [len(r.keys["k1"]) for r in rings] == [32, 32]
    assert rings[0].keys["k1"] != rings[1].keys["k1"]
    assert "data" not in planned  # not mutated
