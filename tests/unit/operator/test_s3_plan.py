"""s3plan: verification of uploaded steps and remote retention, table-tested.

Covers: keepLast and keepEvery milestones (through the shared
``retention.plan_remote``), the newest verified step and the resumed-from
step never deleted, a manifest-less folder that may be in flight kept, an
abandoned partial deleted, the manifest first in every deletion, a checksum
mismatch, a size mismatch, a missing file, an unreadable manifest and a
manifest of another step not verified (and never deleted), size-only
verification when the store has no full-object CRC32C, S3's base64 and
composite checksums, and the ``status.storage`` patch and events.
"""

from __future__ import annotations

import base64
import datetime

import pytest

from cairn.api import checkpointspec, jobstatus
from cairn.api import manifest as manifest_mod
from cairn.operator.core import conditions, jobobserve, lifecycle, s3plan, status

from . import jobs

OBJ = s3plan.RemoteObject
NOW = datetime.datetime(2026, 11, 23, 3, 0, tzinfo=datetime.UTC)
FILES = {"__0_0.distcp": (100, "0a0b0c0d"), ".metadata": (20, "11223344")}


def manifest(step: int, files: dict[str, tuple[int, str]] = FILES) -> manifest_mod.Manifest:
    return manifest_mod.Manifest(
        step=step,
        world_size=1,
        attempt=1,
        created_at=0.0,
        files=tuple(
            manifest_mod.FileEntry(path=p, size=s, crc32c=c, rank=0) for p, (s, c) in files.items()
        ),
    )


def good_objects(*, crc: bool = True, manifest_file: bool = True) -> dict[str, OBJ]:
    objects = {p: OBJ(size=s, crc32c=c if crc else None) for p, (s, c) in FILES.items()}
    if manifest_file:
        objects[manifest_mod.MANIFEST_NAME] = OBJ(size=300, crc32c="deadbeef")
    return objects


def world(
    committed: list[int],
    partial: list[int] = (),  # type: ignore[assignment]
) -> tuple[dict[int, dict[str, OBJ]], dict[int, manifest_mod.Manifest | s3plan.ManifestError]]:
    listing: dict[int, dict[str, OBJ]] = {s: good_objects() for s in committed}
    for step in partial:
        listing[step] = {"__0_0.distcp": OBJ(size=7)}
    manifests: dict[int, manifest_mod.Manifest | s3plan.ManifestError] = {
        s: manifest(s) for s in committed
    }
    return listing, manifests


def run(
    committed: list[int],
    partial: list[int] = (),  # type: ignore[assignment]
    *,
    keep_last: int | None = 2,
    keep_every: int | None = None,
    **kw: object,
) -> s3plan.RemotePlan:
    listing, manifests = world(committed, partial)
    remote = checkpointspec.RemoteRetention(keep_last=keep_last, keep_every=keep_every)
    return s3plan.plan(listing=listing, manifests=manifests, remote=remote, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("committed", "keep_last", "keep_every", "deleted"),
    [
        ([10, 20, 30, 40], 2, None, (10, 20)),
        ([10, 20, 30, 40], 3, None, (10,)),
        ([10, 20, 30, 40], 10, None, ()),
        ([10, 20, 30, 40, 50], 1, 20, (10, 30)),  # milestones 20 and 40 kept
        ([100, 200, 250, 300, 350], 2, 100, (250,)),
        ([10, 20, 30], None, None, ()),  # keepLast unset: keep everything
        ([10], 1, None, ()),
    ],
)
def test_keep_last_and_milestones(
    committed: list[int], keep_last: int | None, keep_every: int | None, deleted: tuple[int, ...]
) -> None:
    result = run(committed, keep_last=keep_last, keep_every=keep_every)
    assert result.deleted_steps == deleted
    assert result.verified_steps == tuple(committed)
    assert result.kept == tuple(s for s in committed if s not in deleted)


def test_no_remote_retention_deletes_nothing() -> None:
    listing, manifests = world([10, 20, 30, 40], partial=[5])
    result = s3plan.plan(listing=listing, manifests=manifests, remote=None)
    assert result.deletions == ()
    assert result.newest_verified is not None
    assert result.newest_verified.step == 40


def test_resumed_from_step_is_kept() -> None:
    result = run([10, 20, 30, 40], keep_last=1, protected=frozenset({20}))
    assert result.deleted_steps == (10, 30)


def test_newest_verified_kept_even_when_newer_manifests_are_corrupt() -> None:
    listing, manifests = world([10, 20, 30, 40])
    listing[40]["__0_0.distcp"] = OBJ(size=100, crc32c="ffffffff")
    listing[30].pop(".metadata")
    remote = checkpointspec.RemoteRetention(keep_last=1)
    result = s3plan.plan(listing=listing, manifests=manifests, remote=remote)
    assert result.newest_verified is not None
    assert result.newest_verified.step == 20
    # 20 is the newest good one; corrupt 30 and 40 are kept for inspection.
    assert result.deleted_steps == (10,)
    assert [v.step for v in result.failed] == [30, 40]
    assert result.kept == (20, 30, 40)


def test_partial_newer_than_newest_manifest_is_kept() -> None:
    result = run([10, 20], partial=[30], keep_last=1)
    assert result.deleted_steps == (10,)


def test_partial_in_flight_or_not_older_than_last_commit_is_kept() -> None:
    # The job resumed from an older step: 15 and 25 are being uploaded again.
    assert run([10, 20, 30], partial=[15], keep_last=5, in_flight=frozenset({15})).deletions == ()
    assert run([10, 20, 30], partial=[25], keep_last=5, last_committed=25).deletions == ()


def test_abandoned_partial_is_deleted() -> None:
    result = run([10, 20, 30], partial=[15, 25], keep_last=5, last_committed=30)
    assert [(d.step, d.partial) for d in result.deletions] == [(15, True), (25, True)]
    assert result.deletions[0].paths == ("__0_0.distcp",)


def test_partials_stay_until_something_is_verified() -> None:
    listing = {5: {"__0_0.distcp": OBJ(size=1)}}
    result = s3plan.plan(
        listing=listing, manifests={}, remote=checkpointspec.RemoteRetention(keep_last=1)
    )
    assert result.deletions == ()
    assert result.newest_verified is None


def test_manifest_is_deleted_first() -> None:
    result = run([10, 20, 30], keep_last=1)
    for deletion in result.deletions:
        assert deletion.paths[0] == manifest_mod.MANIFEST_NAME
        assert sorted(deletion.paths[1:]) == sorted(FILES)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"__0_0.distcp": OBJ(size=100, crc32c="00000000")}, "CRC32C 00000000, manifest says"),
        ({"__0_0.distcp": OBJ(size=99, crc32c="0a0b0c0d")}, "has 99 bytes, manifest says 100"),
        ({"__0_0.distcp": None}, "__0_0.distcp is missing"),
    ],
)
def test_mismatch_is_not_verified(change: dict[str, OBJ | None], reason: str) -> None:
    objects = good_objects()
    for path, value in change.items():
        if value is None:
            objects.pop(path)
        else:
            objects[path] = value
    verdict = s3plan.verify_step(step=10, objects=objects, manifest=manifest(10))
    assert not verdict.verified
    assert reason in verdict.reason


def test_unreadable_or_foreign_manifest_is_not_verified() -> None:
    bad = s3plan.verify_step(
        step=10, objects=good_objects(), manifest=s3plan.ManifestError(message="not JSON")
    )
    assert (bad.verified, bad.reason) == (False, "manifest unreadable: not JSON")
    other = s3plan.verify_step(step=10, objects=good_objects(), manifest=manifest(11))
    assert not other.verified
    assert "step 11" in other.reason


def test_size_only_when_the_store_has_no_full_object_checksum() -> None:
    verdict = s3plan.verify_step(step=10, objects=good_objects(crc=False), manifest=manifest(10))
    assert (verdict.verified, verdict.method) == (True, "size")
    assert "2 of 2 files checked by size only" in verdict.reason
    full = s3plan.verify_step(step=10, objects=good_objects(), manifest=manifest(10))
    assert (full.verified, full.method, full.reason) == (True, "crc32c", "")
    assert (full.files, full.bytes) == (2, 120)


def test_s3_checksum_conversion() -> None:
    value = base64.b64encode(bytes.fromhex("c99465aa")).decode()
    assert s3plan.crc32c_hex_from_s3(value) == "c99465aa"
    assert s3plan.crc32c_hex_from_s3(value, "FULL_OBJECT") == "c99465aa"
    assert s3plan.crc32c_hex_from_s3("OWtABQ==-3") is None
    assert s3plan.crc32c_hex_from_s3(value, "COMPOSITE") is None
    assert s3plan.crc32c_hex_from_s3(None) is None
    assert s3plan.crc32c_hex_from_s3("not base64!") is None


def test_storage_update_patch_and_events() -> None:
    listing, manifests = world([10, 20, 30])
    listing[30]["__0_0.distcp"] = OBJ(size=100, crc32c="ffffffff")
    result = s3plan.plan(
        listing=listing, manifests=manifests, remote=checkpointspec.RemoteRetention(keep_last=1)
    )
    patch, notices = s3plan.storage_update(
        previous=None, result=result, deleted=result.deleted_steps, error=None, now=NOW
    )
    assert patch == {
        "verifiedStep": 20,
        "verifiedTime": "2026-11-23T03:00:00Z",
        "verifiedBy": "crc32c",
        "corruptSteps": [30],
        "remoteSteps": [20, 30],
        "lastRetentionTime": "2026-11-23T03:00:00Z",
    }
    assert [(n.type, n.reason) for n in notices] == [
        ("Normal", "CheckpointVerified"),
        ("Warning", "VerificationFailed"),
        ("Normal", "RetentionDeleted"),
    ]
    assert "step 30 failed verification" in notices[1].message
    assert notices[2].message == "deleted steps 10 from S3"
    # The same observation again, recorded: no patch, no events.
    recorded = jobstatus.StorageStatus.model_validate(patch)
    again = s3plan.plan(
        listing={s: listing[s] for s in (20, 30)},
        manifests=manifests,
        remote=checkpointspec.RemoteRetention(keep_last=1),
    )
    assert s3plan.storage_update(
        previous=recorded, result=again, deleted=(), error=None, now=NOW
    ) == (None, ())


def test_storage_update_error_only_touches_last_error() -> None:
    before = jobstatus.StorageStatus(verified_step=20, remote_steps=[20])
    patch, notices = s3plan.storage_update(
        previous=before, result=None, deleted=(), error="listing failed: AccessDenied", now=NOW
    )
    assert (patch, notices) == ({"lastError": "listing failed: AccessDenied"}, ())
    failed = before.model_copy(update={"last_error": "x"})
    listing, manifests = world([20])
    ok = s3plan.plan(listing=listing, manifests=manifests, remote=None)
    patch, _ = s3plan.storage_update(previous=failed, result=ok, deleted=(), error=None, now=NOW)
    assert patch == {"lastError": None, "verifiedBy": "crc32c"}


@pytest.mark.parametrize(
    ("storage", "reason"),
    [
        (None, conditions.REASON_UPLOADED),
        ({"verifiedStep": 5}, conditions.REASON_VERIFIED),
        ({"verifiedStep": 4}, conditions.REASON_UPLOADED),  # an older step verified only
    ],
)
def test_uploaded_condition_says_verified_from_the_operators_check(
    storage: dict[str, int] | None, reason: str
) -> None:
    job_status: dict[str, object] = {
        "phase": "Running",
        "attempt": 1,
        "checkpoints": {"lastUploaded": {"step": 5, "verified": False}},
    }
    if storage is not None:
        job_status["storage"] = storage
    job = jobs.job(job_status, checkpoint={"upload": {"uri": "s3://bkt/p"}})
    decision = lifecycle.decide(job=job, observed=jobobserve.Observed(pods=()), now=NOW)
    found = [
        c
        for c in status.desired_conditions(job, decision, NOW)
        if c.type == conditions.CHECKPOINT_UPLOADED
    ]
    assert [(c.status, c.reason) for c in found] == [(True, reason)]


def test_step_with_a_manifest_moved_aside_is_never_a_partial() -> None:
    # Step 15 was superseded (or quarantined): its manifest now lives under
    # .cairn/ and still references the data left in step-000000015/.
    assert run([10, 20, 30], partial=[15], keep_last=5, aside=frozenset({15})).deletions == ()
    assert run([10, 20, 30], partial=[15], keep_last=5).deleted_steps == (15,)


def test_partial_keeps_another_jobs_attempt_scoped_data() -> None:
    listing, manifests = world([10, 20, 30])
    listing[15] = {
        "a3-aaaaaaaa/__0_0.distcp": OBJ(size=7),
        "a1-bbbbbbbb/__0_0.distcp": OBJ(size=7),
        "__1_0.distcp": OBJ(size=7),
    }
    remote = checkpointspec.RemoteRetention(keep_last=5)
    result = s3plan.plan(listing=listing, manifests=manifests, remote=remote, own_uid8="aaaaaaaa")
    (deletion,) = result.deletions
    assert deletion.partial
    # Ours (attempt-scoped, and the pre-attempt-scoped layout) go; the other job's stays.
    assert deletion.paths == ("__1_0.distcp", "a3-aaaaaaaa/__0_0.distcp")


def test_rotation_takes_this_jobs_leftovers_of_a_killed_attempt_in_one_pass() -> None:
    # Attempt 1 was killed between its ranks' uploads of step 15 and the
    # manifest; attempt 2 committed step 15 beside those objects. Rotating
    # step 15 away leaves no manifest-less folder of ours for a later pass.
    listing, manifests = world([15, 20, 30, 40])
    listing[15] = {
        **listing[15],
        "a1-aaaaaaaa/__0_0.distcp": OBJ(size=7),
        "a1-aaaaaaaa/.metadata": OBJ(size=3),
        "a1-bbbbbbbb/__0_0.distcp": OBJ(size=7),  # another job's: kept
        "README": OBJ(size=1),  # unprefixed and unlisted: the manifest-less rule's
    }
    remote = checkpointspec.RemoteRetention(keep_last=3)
    result = s3plan.plan(listing=listing, manifests=manifests, remote=remote, own_uid8="aaaaaaaa")
    (deletion,) = result.deletions
    assert (deletion.step, deletion.partial) == (15, False)
    assert deletion.paths == (
        manifest_mod.MANIFEST_NAME,
        *sorted(FILES),
        "a1-aaaaaaaa/.metadata",
        "a1-aaaaaaaa/__0_0.distcp",
    )
    # Without identity nothing but the manifest and what it lists is deleted.
    (anonymous,) = s3plan.plan(listing=listing, manifests=manifests, remote=remote).deletions
    assert anonymous.paths == (manifest_mod.MANIFEST_NAME, *sorted(FILES))


def test_rotation_takes_a_fenced_rank_groups_leftovers_too() -> None:
    # Group 0 of attempt 1 uploaded part of step 15 and lost a rank before
    # the manifest; group 1 (in place) committed step 15 beside it. Its
    # objects are this job's (``a1g0``'s prefix is ``a1``; later groups
    # ``a1g<g>``): rotating step 15 away takes them with it.
    listing, manifests = world([15, 20, 30, 40])
    listing[15] = {
        **listing[15],
        "a1g2-aaaaaaaa/__0_0.distcp": OBJ(size=7),
        "a1g3-bbbbbbbb/__0_0.distcp": OBJ(size=7),  # another job's: kept
    }
    remote = checkpointspec.RemoteRetention(keep_last=3)
    result = s3plan.plan(listing=listing, manifests=manifests, remote=remote, own_uid8="aaaaaaaa")
    (deletion,) = result.deletions
    assert deletion.paths[-1] == "a1g2-aaaaaaaa/__0_0.distcp"
    assert "a1g3-bbbbbbbb/__0_0.distcp" not in deletion.paths


def test_partial_keeps_another_jobs_group_scoped_data() -> None:
    listing, manifests = world([10, 20, 30])
    listing[15] = {
        "a2g1-aaaaaaaa/__0_0.distcp": OBJ(size=7),
        "a2g1-bbbbbbbb/__0_0.distcp": OBJ(size=7),
    }
    remote = checkpointspec.RemoteRetention(keep_last=5)
    result = s3plan.plan(listing=listing, manifests=manifests, remote=remote, own_uid8="aaaaaaaa")
    (deletion,) = result.deletions
    assert deletion.paths == ("a2g1-aaaaaaaa/__0_0.distcp",)


def test_rotation_keeps_leftovers_a_superseded_manifest_still_lists() -> None:
    # Step 15's older lineage was moved aside under .cairn/ and its manifest
    # there lists a1-… data in this folder: rotating the new step 15 keeps it.
    listing, manifests = world([15, 20, 30, 40])
    listing[15] = {**listing[15], "a1-aaaaaaaa/__0_0.distcp": OBJ(size=7)}
    remote = checkpointspec.RemoteRetention(keep_last=3)
    result = s3plan.plan(
        listing=listing,
        manifests=manifests,
        remote=remote,
        own_uid8="aaaaaaaa",
        aside=frozenset({15}),
    )
    (deletion,) = result.deletions
    assert "a1-aaaaaaaa/__0_0.distcp" not in deletion.paths
