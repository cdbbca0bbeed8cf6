"""Bounded `.cairn/` folders: rotation prunes what was moved aside, on real files.

Covers `aside.plan_prune` / `aside.prune` through `rotation.rotate`:
- per kind, the newest `keep_aside` quarantined and superseded folders stay
  and older ones of THIS job are deleted (folder and reason file);
- another job's quarantined/superseded folders (a re-created job on an old
  volume), `legacy` superseded steps and every `foreign` folder are never
  deleted, however many there are;
- the committed steps in the main namespace are untouched by the pruning;
- a reason file beside no folder (a crash between the reason file and the
  rename) of this job is removed once older than the grace; a young one (a
  move in flight), one whose folder exists, and another job's are kept.
"""

from __future__ import annotations

import os
import pathlib

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import aside, events, layout, lineage, options, rotation

UID = "cccccccc-0000-4000-8000-000000000003"
OTHER = "dddddddd-0000-4000-8000-000000000004"


def _step(root: pathlib.Path, step: int, *, job_uid: str) -> pathlib.Path:
    """A committed step folder with one data file."""
    tmp = layout.tmp_step_dir(root, step, job_uid=job_uid, attempt=0)
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(b"x" * 16)
    entry = layout.entry_for(tmp, "__0_0.distcp", rank=0)
    manifest = manifest_mod.Manifest(
        step=step, world_size=1, attempt=0, created_at=0.0, files=(entry,), job_uid=job_uid
    )
    final = layout.step_dir(root, step)
    layout.commit_folder(tmp, final, manifest)
    return final


def _move(
    root: pathlib.Path, step: int, *, kind: aside.Kind, tag: str, at: float, job_uid: str = UID
) -> pathlib.Path:
    """Commit a step, move it aside, and date the move `at` (its reason file's mtime)."""
    moved = aside.move_aside_local(
        root, _step(root, step, job_uid=job_uid), kind=kind, tag=tag, reason="test"
    )
    os.utime(moved.with_name(f"{moved.name}{aside.REASON_SUFFIX}"), (at, at))
    return moved


def _rotate(root: pathlib.Path, *, keep_aside: int) -> list[events.ProgressEvent]:
    seen: list[events.ProgressEvent] = []
    opts = options.CheckpointOptions(directory=root, job_uid=UID, keep_aside=keep_aside)
    rotation.rotate(opts, rank=0, in_flight=frozenset(), callbacks=[seen.append])
    return seen


def test_rotation_keeps_the_newest_quarantined_and_superseded_per_kind(
    tmp_path: pathlib.Path,
) -> None:
    quarantined = [
        _move(tmp_path, 10 + i, kind="quarantine", tag=f"{UID[:8]}-a{i}", at=1000.0 + i)
        for i in range(4)
    ]
    superseded = [
        _move(tmp_path, 20 + i, kind="superseded", tag=f"{UID[:8]}-a0", at=2000.0 + i)
        for i in range(3)
    ]
    live = _step(tmp_path, 30, job_uid=UID)

    seen = _rotate(tmp_path, keep_aside=2)

    assert [p.exists() for p in quarantined] == [False, False, True, True]
    assert [p.exists() for p in superseded] == [False, True, True]
    for gone in (*quarantined[:2], superseded[0]):
        assert not gone.with_name(f"{gone.name}{aside.REASON_SUFFIX}").exists()
    assert layout.is_committed(live, job_uid=UID)  # the main namespace is not pruning's
    pruned = sorted(e.step for e in seen if e.phase == "deleted")
    assert pruned == [10, 11, 20]


def test_rotation_never_prunes_foreign_legacy_or_another_jobs_folders(
    tmp_path: pathlib.Path,
) -> None:
    kept = [
        *(
            _move(tmp_path, 40 + i, kind="foreign", tag="dcp", at=3000.0 + i, job_uid=OTHER)
            for i in range(3)
        ),
        *(
            _move(tmp_path, 50 + i, kind="quarantine", tag=f"{OTHER[:8]}-a{i}", at=10.0 + i)
            for i in range(3)
        ),
        *(
            _move(tmp_path, 60 + i, kind="superseded", tag=lineage.LEGACY_LINEAGE, at=20.0 + i)
            for i in range(3)
        ),
    ]
    newest_own = _move(tmp_path, 70, kind="quarantine", tag=f"{UID[:8]}-a9", at=9000.0)

    seen = _rotate(tmp_path, keep_aside=1)

    assert all(p.exists() for p in kept)  # older than the one kept, but not ours
    assert newest_own.exists()
    assert [e for e in seen if e.phase == "deleted"] == []


def test_plan_prune_counts_every_folder_of_a_kind_toward_keep(tmp_path: pathlib.Path) -> None:
    """Another job's newer folders fill the kept slots; only own older ones go."""
    own_old = _move(tmp_path, 80, kind="quarantine", tag=f"{UID[:8]}-a1", at=100.0)
    _move(tmp_path, 81, kind="quarantine", tag=f"{OTHER[:8]}-a1", at=200.0)
    entries = aside.observe(tmp_path)
    assert [e.folder for e in aside.plan_prune(entries, job_uid=UID, keep=1)] == [own_old]
    assert aside.plan_prune(entries, job_uid=UID, keep=2) == ()


def test_orphaned_reason_files_of_this_job_are_pruned_after_the_grace(
    tmp_path: pathlib.Path,
) -> None:
    tag = f"{UID[:8]}-a1"
    kept = _move(tmp_path, 10, kind="quarantine", tag=tag, at=1000.0)
    parent = aside.aside_dir(tmp_path, kind="quarantine", tag=tag)
    old_orphan = parent / f"step-00000011{aside.REASON_SUFFIX}"
    young_orphan = parent / f"step-00000012{aside.REASON_SUFFIX}"
    other_tag = aside.aside_dir(tmp_path, kind="quarantine", tag=f"{OTHER[:8]}-a1")
    other_tag.mkdir(parents=True)
    others_orphan = other_tag / f"step-00000013{aside.REASON_SUFFIX}"
    for path in (old_orphan, young_orphan, others_orphan):
        path.write_text("kind: quarantine\n")
    for path in (old_orphan, others_orphan):
        os.utime(path, (1000.0, 1000.0))

    _rotate(tmp_path, keep_aside=5)

    assert not old_orphan.exists()
    assert young_orphan.exists(), "a move in flight keeps its reason file"
    assert others_orphan.exists(), "another job's files are never ours to delete"
    assert kept.exists() and kept.with_name(f"{kept.name}{aside.REASON_SUFFIX}").exists()
