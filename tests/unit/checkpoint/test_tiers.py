"""Which tiers keep a committed step (`cairn.checkpoint.tiers`), its markers on
a volume (`layout`), the clean end's promotion of the newest local-only step
(`upload_backlog.promote_newest`), and the spec field that thins uploads
(`checkpoint.upload.intervalSteps`). Pure, plus tmp folders for the markers."""

from __future__ import annotations

import pathlib

import pydantic
import pytest

from cairn.api import checkpointspec
from cairn.api import manifest as manifest_mod
from cairn.checkpoint import layout, options, tiers, upload_backlog


def _opts(tmp_path: pathlib.Path, **kw: object) -> options.CheckpointOptions:
    return options.CheckpointOptions(directory=tmp_path, **kw)  # type: ignore[arg-type]


S3 = options.S3Options(uri="s3://bucket/prefix")


@pytest.mark.parametrize(
    ("step", "every", "final", "owed"),
    [
        (3, None, False, True),  # no interval: every step
        (10, 10, False, True),
        (20, 10, False, True),
        (0, 10, False, True),  # step 0 is divisible
        (11, 10, False, False),
        (19, 10, False, False),
        (13, 10, True, True),  # a final save may be the last chance to leave the pods
        (5, 1, False, True),
    ],
)
def test_upload_owed(step: int, every: int | None, final: bool, owed: bool) -> None:
    assert tiers.upload_owed(step, every=every, final=final) is owed


def test_only_a_job_that_uploads_marks_steps_local_only(tmp_path: pathlib.Path) -> None:
    assert not tiers.local_only(11, opts=_opts(tmp_path), final=False)  # no S3: no marker
    with_s3 = _opts(tmp_path, s3=S3, interval_steps=5, upload_interval_steps=10)
    assert not tiers.local_only(10, opts=with_s3, final=False)
    assert tiers.local_only(11, opts=with_s3, final=False)
    assert not tiers.local_only(11, opts=with_s3, final=True)


def test_in_pod_tiers(tmp_path: pathlib.Path) -> None:
    assert tiers.in_pod(_opts(tmp_path)) == ("volume",)
    mem = tmp_path / "mem"
    assert tiers.in_pod(_opts(tmp_path, memory_dir=mem)) == ("memory", "peer", "volume")
    assert tiers.in_pod(_opts(tmp_path, memory_dir=mem, memory_replicas=0)) == (
        "memory",
        "volume",
    )


def _committed(root: pathlib.Path, step: int, *, local_only: bool) -> None:
    folder = layout.step_dir(root, step)
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"x")
    entry = layout.entry_for(folder, "__0_0.distcp", rank=0)
    doc = manifest_mod.Manifest(step=step, world_size=1, attempt=0, created_at=0.0, files=(entry,))
    layout.write_manifest_exclusive(folder, doc)
    if local_only:
        layout.mark_local_only(folder)


@pytest.mark.parametrize(
    ("committed", "promoted"),
    [
        ([], None),
        ([(4, False), (5, True)], 5),
        ([(5, True), (4, False)], 5),  # the order they were written in does not matter
        ([(4, True), (8, False)], None),  # the newest is owed already
        ([(3, True)], 3),
    ],
)
def test_a_clean_end_promotes_the_newest_step_only(
    tmp_path: pathlib.Path, committed: list[tuple[int, bool]], promoted: int | None
) -> None:
    for step, local_only in committed:
        _committed(tmp_path, step, local_only=local_only)
    pending = upload_backlog.pending_steps(tmp_path, job_uid=None)
    assert pending == sorted(step for step, local_only in committed if not local_only)
    assert upload_backlog.promote_newest(tmp_path, job_uid=None) == promoted
    still_local = sorted(step for step, local_only in committed if local_only and step != promoted)
    assert [
        s for s, _ in sorted(committed) if layout.is_local_only(layout.step_dir(tmp_path, s))
    ] == still_local
    if promoted is not None:
        assert promoted in upload_backlog.pending_steps(tmp_path, job_uid=None)


def test_a_newer_folder_that_is_not_committed_is_not_promoted(tmp_path: pathlib.Path) -> None:
    _committed(tmp_path, 4, local_only=True)
    layout.step_dir(tmp_path, 8).mkdir()  # no manifest: not a committed step
    assert upload_backlog.promote_newest(tmp_path, job_uid=None) == 4


def test_local_only_marker_round_trip(tmp_path: pathlib.Path) -> None:
    assert not layout.is_local_only(tmp_path)
    assert not layout.clear_local_only(tmp_path)  # nothing to clear
    layout.mark_local_only(tmp_path)
    assert layout.is_local_only(tmp_path)
    assert layout.clear_local_only(tmp_path)
    assert not layout.is_local_only(tmp_path)


@pytest.mark.parametrize(
    ("every", "saves"),
    [(0, 1), (10, 4), (10, None)],  # zero; not a multiple; saves by time (intervalSeconds)
)
def test_options_refuse_an_upload_interval_that_picks_no_saves(
    tmp_path: pathlib.Path, every: int, saves: int | None
) -> None:
    with pytest.raises(ValueError, match="upload_interval_steps must be a multiple"):
        _opts(tmp_path, s3=S3, interval_steps=saves, upload_interval_steps=every)


def _spec(**ckpt: object) -> checkpointspec.CheckpointSpec:
    return checkpointspec.CheckpointSpec.model_validate(ckpt)


def test_spec_upload_interval_a_multiple_of_the_save_interval() -> None:
    spec = _spec(intervalSteps=1, upload={"uri": "s3://bucket-a/prefix", "intervalSteps": 10})
    assert spec.upload is not None and spec.upload.interval_steps == 10
    assert _spec(intervalSteps=5, upload={"uri": "s3://bucket-a/prefix", "intervalSteps": 15})
    with pytest.raises(pydantic.ValidationError, match="multiple of intervalSteps"):
        _spec(intervalSteps=4, upload={"uri": "s3://bucket-a/prefix", "intervalSteps": 10})
    with pytest.raises(pydantic.ValidationError, match="multiple of intervalSteps"):
        _spec(intervalSeconds=60, upload={"uri": "s3://bucket-a/prefix", "intervalSteps": 10})
