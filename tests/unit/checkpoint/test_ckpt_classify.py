"""The one classification of step folders, start-up clean-up, fence records, lineage rules.

Covers (real temporary folders, no torch processes): `layout.classify` for
every kind (committed incl. unknown fields; foreign by job UID, by a
missing job UID (an older Cairn's or a forged manifest: issue #19), plain
DCP, another job's marker; unreadable for a newer
version, invalid JSON, a wrong step, an unreadable file; partial_own by
marker or temporary folder; unknown); start-up deletes only own partials of
earlier attempts; the commit rename refuses an existing step; the fence file
reads the old integer format and lets a re-created job start; the pure
lineage decision (continue, branch, fresh start over old steps) and the
save check.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import errors, fence, layout, lineage, startup

UID = "0123abcd-0000-4000-8000-000000000000"
OTHER = "fedc9876-0000-4000-8000-000000000000"


def write_manifest(folder: pathlib.Path, step: int, **fields: object) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"step": step, "world_size": 1, "attempt": 0, "created_at": 0.0, "files": [], **fields}
    (folder / "manifest.json").write_text(json.dumps(doc))


@pytest.mark.parametrize(
    ("fields", "kind"),
    [
        ({}, "foreign"),
        ({"job_uid": UID, "lineage": "0123abcd-a0", "future_field": [1]}, "committed"),
        ({"job_uid": OTHER}, "foreign"),
        ({"format_version": 2}, "unreadable"),
        ({"step": 9}, "unreadable"),
    ],
    ids=["no-job-uid", "ours-with-unknown-field", "other-job", "newer-version", "wrong-step"],
)
def test_classify_by_manifest(tmp_path: pathlib.Path, fields: dict[str, object], kind: str) -> None:
    folder = layout.step_dir(tmp_path, 3)
    write_manifest(folder, 3)
    if fields:
        doc = json.loads((folder / "manifest.json").read_text())
        doc.update(fields)
        (folder / "manifest.json").write_text(json.dumps(doc))
    assert layout.classify(folder, job_uid=UID) == kind


def test_classify_without_manifest(tmp_path: pathlib.Path) -> None:
    garbage = layout.step_dir(tmp_path, 1)
    garbage.mkdir()
    (garbage / "manifest.json").write_bytes(b"{not json")
    plain = layout.step_dir(tmp_path, 2)
    plain.mkdir()
    (plain / ".metadata").write_bytes(b"dcp")
    ours = layout.step_dir(tmp_path, 3)
    ours.mkdir()
    layout.write_writer_marker(ours, job_uid=UID, attempt=1)
    theirs = layout.step_dir(tmp_path, 4)
    theirs.mkdir()
    layout.write_writer_marker(theirs, job_uid=OTHER, attempt=1)
    bare = layout.step_dir(tmp_path, 5)
    bare.mkdir()
    (bare / "__0_0.distcp").write_bytes(b"?")
    tmp_ours = layout.tmp_step_dir(tmp_path, 6, job_uid=UID, attempt=2)
    tmp_ours.mkdir()
    write_manifest(tmp_ours, 6)  # a manifest in a temporary folder is not a commit
    tmp_theirs = layout.tmp_step_dir(tmp_path, 6, job_uid=OTHER, attempt=2)
    tmp_theirs.mkdir()
    kinds = {
        f.name: layout.classify(f, job_uid=UID)
        for f in (garbage, plain, ours, theirs, bare, tmp_ours, tmp_theirs)
    }
    assert list(kinds.values()) == [
        "unreadable",
        "foreign",
        "partial_own",
        "foreign",
        "unknown",
        "partial_own",
        "unknown",
    ]


def test_a_manifest_that_cannot_be_read_is_unreadable_not_garbage(
    tmp_path: pathlib.Path,
) -> None:
    folder = layout.step_dir(tmp_path, 1)
    (folder / "manifest.json").mkdir(parents=True)  # reading it raises an OSError
    assert layout.classify(folder, job_uid=None) == "unreadable"


def test_start_up_deletes_only_own_partials_of_earlier_attempts(tmp_path: pathlib.Path) -> None:
    old_tmp = layout.tmp_step_dir(tmp_path, 4, job_uid=UID, attempt=0)
    old_tmp.mkdir()
    current_tmp = layout.tmp_step_dir(tmp_path, 4, job_uid=UID, attempt=1)
    current_tmp.mkdir()
    marked = layout.step_dir(tmp_path, 2)
    marked.mkdir()
    layout.write_writer_marker(marked, job_uid=UID, attempt=0)
    newer = layout.step_dir(tmp_path, 3)
    write_manifest(newer, 3, format_version=7)
    plain = layout.step_dir(tmp_path, 7)
    plain.mkdir()
    (plain / ".metadata").write_bytes(b"dcp")
    seen: list[str] = []
    survey = startup.prepare(
        tmp_path, job_uid=UID, attempt=1, rank=0, callbacks=[lambda e: seen.append(e.phase)]
    )
    assert not old_tmp.exists() and not marked.exists()
    assert current_tmp.exists() and newer.exists() and plain.exists()
    assert sorted(f.step for f in survey.kept) == [3, 7]
    assert seen == ["kept", "kept"]
    assert fence.read_record(tmp_path) == fence.FenceRecord(job_uid=UID, attempt=1)


def test_commit_rename_refuses_an_existing_step(tmp_path: pathlib.Path) -> None:
    record = manifest_mod.Manifest(
        step=1, world_size=1, attempt=0, created_at=0.0, files=(), job_uid=UID
    )
    first = layout.tmp_step_dir(tmp_path, 1, job_uid=UID, attempt=0)
    first.mkdir()
    layout.commit_folder(first, layout.step_dir(tmp_path, 1), record)
    assert layout.is_committed(layout.step_dir(tmp_path, 1), job_uid=UID)
    second = layout.tmp_step_dir(tmp_path, 1, job_uid=UID, attempt=1)
    second.mkdir()
    with pytest.raises(errors.FencedError, match="already exists"):
        layout.commit_folder(second, layout.step_dir(tmp_path, 1), record)
    empty = layout.step_dir(tmp_path, 2)
    empty.mkdir()  # os.rename would silently replace an empty folder
    third = layout.tmp_step_dir(tmp_path, 2, job_uid=UID, attempt=1)
    third.mkdir()
    with pytest.raises(errors.FencedError):
        layout.commit_folder(third, empty, record.model_copy(update={"step": 2}))


def test_fence_file_formats_and_job_identity(tmp_path: pathlib.Path) -> None:
    (tmp_path / fence.FENCE_NAME).write_text("3\n")  # an older Cairn's fence
    assert fence.read_record(tmp_path) == fence.FenceRecord(job_uid=None, attempt=3)
    with pytest.raises(errors.FencedError):
        fence.raise_local(tmp_path, job_uid=UID, attempt=2)
    fence.raise_local(tmp_path, job_uid=UID, attempt=4)
    zombie = fence.LocalFence(root=tmp_path, job_uid=UID)
    with pytest.raises(errors.FencedError, match="attempt 4"):
        zombie.check(3)
    # A re-created job (new UID) starts at attempt 0 on the old volume...
    fence.raise_local(tmp_path, job_uid=OTHER, attempt=0)
    fence.LocalFence(root=tmp_path, job_uid=OTHER).check(0)
    # ...and from then on the old job's writers are refused.
    with pytest.raises(errors.FencedError, match="taken over"):
        zombie.check(4)


_Want = tuple[str, tuple[int, str] | None, tuple[int, ...], int | None]
LINEAGE_CASES: dict[str, tuple[int | None, dict[int, str | None], _Want]] = {
    # name: (loaded, own steps -> lineage, (lineage, parent, supersede, latest))
    "continue-newest": (8, {2: "l0", 4: "l0", 8: "l0"}, ("l0", None, (), 8)),
    "rollback": (4, {2: "l0", 4: "l0", 6: "l0", 8: "l0"}, ("0123abcd-a3", (4, "l0"), (6, 8), 4)),
    "fresh-over-old-steps": (None, {2: "l0", 4: "l0"}, ("0123abcd-a3", None, (2, 4), None)),
    "fresh": (None, {}, ("0123abcd-a3", None, (), None)),
    "older-cairn-newest": (4, {4: None}, ("0123abcd-a3", None, (), 4)),
}


@pytest.mark.parametrize("name", list(LINEAGE_CASES))
def test_lineage_decision(name: str) -> None:
    loaded, own, (lineage_id, parent, supersede, latest) = LINEAGE_CASES[name]
    decision = lineage.decide(
        loaded=loaded,
        loaded_lineage=None if loaded is None else own.get(loaded),
        own_steps=own.keys(),
        job_uid=UID,
        attempt=3,
    )
    assert decision.lineage == lineage_id
    want_parent = None if parent is None else manifest_mod.Parent(step=parent[0], lineage=parent[1])
    assert decision.parent == want_parent
    assert (decision.supersede, decision.latest) == (supersede, latest)
    assert lineage.Decision.from_json(decision.to_json()) == decision


def test_an_import_always_branches_and_supersedes_an_own_step_of_its_number() -> None:
    # A foreign step 4 imported into a job that has its own steps 2, 4, 6:
    # the job's own 4 and 6 go aside (a restart before the first save must
    # not resume from the job's own 4 as if it were the import); 2 stays.
    decision = lineage.decide(
        loaded=4,
        loaded_lineage=None,
        own_steps={2: "l0", 4: "l0", 6: "l0"}.keys(),
        job_uid=UID,
        attempt=3,
        imported=True,
    )
    assert decision.lineage == "0123abcd-a3"
    assert decision.parent == manifest_mod.Parent(step=4, lineage=None)
    assert (decision.supersede, decision.latest) == ((4, 6), 4)
    # Even when the imported step number is this job's newest, it never continues.
    again = lineage.decide(
        loaded=6, loaded_lineage=None, own_steps=[2, 6], job_uid=UID, attempt=3, imported=True
    )
    assert again.supersede == (6,) and again.lineage == "0123abcd-a3"


def test_save_check_refuses_steps_at_or_below_latest() -> None:
    lineage.check_save(5, latest=4, lineage="l")
    lineage.check_save(1, latest=None, lineage="l")
    for step in (3, 4):
        with pytest.raises(errors.CheckpointError, match="refused"):
            lineage.check_save(step, latest=4, lineage="l")


def _manifest(
    step: int, *, attempt: int, created_at: float, lineage_id: str
) -> manifest_mod.Manifest:
    return manifest_mod.Manifest(
        step=step,
        world_size=1,
        attempt=attempt,
        created_at=created_at,
        files=(),
        job_uid=UID,
        lineage=lineage_id,
    )


def test_a_stale_branch_record_never_moves_a_newer_step_of_the_same_number() -> None:
    branch = lineage.Decision(
        lineage="0123abcd-a1",
        parent=manifest_mod.Parent(step=4, lineage="0123abcd-a0"),
        supersede=(6, 8),
        latest=4,
    )
    old = {
        s: _manifest(s, attempt=0, created_at=float(s), lineage_id="0123abcd-a0") for s in (6, 8)
    }
    expect = lineage.identities(branch, old)
    assert lineage.to_move(branch, old, expect) == {6: "0123abcd-a0", 8: "0123abcd-a0"}
    # After the branch, the new lineage committed 6 again; the record is finished late.
    now = {6: _manifest(6, attempt=1, created_at=60.0, lineage_id="0123abcd-a1"), 8: old[8]}
    assert lineage.to_move(branch, now, expect) == {8: "0123abcd-a0"}
    assert lineage.to_move(branch, {}, expect) == {}  # already moved: nothing to do


def test_branch_records_of_this_job_only_are_finished() -> None:
    branch = lineage.Decision(lineage="0123abcd-a1", parent=None, supersede=(2,), latest=None)
    record = {"job_uid": UID, "attempt": 1, "pending": branch.to_json(), "expect": {"2": {}}}
    assert lineage.pending_of(record, job_uid=UID) == (branch, {"2": {}})
    assert lineage.pending_of({**record, "job_uid": "another"}, job_uid=UID) is None
    assert lineage.pending_of(None, job_uid=UID) is None
    assert lineage.pending_of({"job_uid": UID}, job_uid=UID) is None


def test_a_node_local_rank_also_moves_its_steps_past_the_lineage_latest() -> None:
    keep = lineage.Decision(lineage="l0", parent=None, supersede=(), latest=4)
    assert lineage.local_supersede(keep, [2, 4]) == keep
    assert lineage.local_supersede(keep, [2, 4, 6, 8]).supersede == (6, 8)
    fresh = lineage.Decision(lineage="l1", parent=None, supersede=(2,), latest=None)
    assert lineage.local_supersede(fresh, [2, 4]).supersede == (2, 4)
