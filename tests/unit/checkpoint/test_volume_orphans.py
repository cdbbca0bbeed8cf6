"""Steps no rank can upload any more: a pod replaced in place lost its volume.

Covers: a step rank 0 owes S3 that another rank's node-local volume lacks is
an orphan (it can never be uploaded, each rank uploads its own files), the
others are not; malformed reports hold nothing; with real folders rank 0
marks its orphaned copy local-only (no longer pending, so no upload round
waits for it) and leaves the rest owed; other ranks only report; a job
without S3 owes nothing, so no rank reports or marks anything.
"""

from typing import Any

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import layout, options, upload_backlog, volume_init


def test_a_step_some_rank_lacks_is_an_orphan() -> None:
    held = [{"steps": [25, 30, 35]}, {"steps": [35]}]  # rank 1's pod was replaced after 30
    assert volume_init.orphans([25, 30, 35], held) == [25, 30]
    assert volume_init.orphans([35], held) == []
    assert volume_init.orphans([5], [{"steps": [5]}, {"steps": "x"}, None]) == [5]
    assert volume_init.orphans([5], [{"steps": [5, True]}, {"steps": [5.0]}]) == [5]


class _Store:
    def __init__(self, rank: int, others: list[dict[str, Any]]) -> None:
        self.rank, self.world_size = rank, len(others) + 1
        self.others = others
        self.published: list[dict[str, Any]] = []

    def publish(self, key: str, value: dict[str, Any]) -> None:
        self.published.append(value)

    def gather(self, key: str, *, timeout: float) -> list[dict[str, Any]]:
        return [*self.published, *self.others]


def _committed(root: Any, step: int) -> None:
    folder = layout.step_dir(root, step)
    folder.mkdir(parents=True)
    (folder / manifest_mod.MANIFEST_NAME).write_text("{}")


def test_rank_0_retires_what_another_rank_lacks(tmp_path: Any, monkeypatch: Any) -> None:
    for step in (25, 30):
        _committed(tmp_path, step)
    monkeypatch.setattr(layout, "committed_steps", lambda root, **_: [25, 30])
    monkeypatch.setattr(
        upload_backlog,
        "pending_steps",
        lambda root, **_: [
            s for s in (25, 30) if not layout.is_local_only(layout.step_dir(root, s))
        ],
    )
    volumes = volume_init.Volumes(
        opts=options.CheckpointOptions(
            directory=tmp_path, attempt=1, s3=options.S3Options(uri="s3://b/p")
        ),
        rank=0,
        shared=False,
        s3=None,
        callbacks=(),
    )
    store = _Store(0, [{"steps": [30]}])
    assert volume_init.retire_orphans(volumes, coordinator=store) == [25]  # type: ignore[arg-type]
    assert store.published == [{"steps": [25, 30]}]
    assert layout.is_local_only(layout.step_dir(tmp_path, 25))
    assert not layout.is_local_only(layout.step_dir(tmp_path, 30))
    assert upload_backlog.pending_steps(tmp_path, job_uid=None) == [30]
    # Another rank reports and returns: rank 0 decides.
    follower = _Store(1, [])
    other = volume_init.Volumes(opts=volumes.opts, rank=1, shared=False, s3=None, callbacks=())
    assert volume_init.retire_orphans(other, coordinator=follower) == []  # type: ignore[arg-type]
    assert follower.published == [{"steps": [25, 30]}]


def test_a_job_without_s3_retires_nothing(tmp_path: Any) -> None:
    _committed(tmp_path, 25)
    volumes = volume_init.Volumes(
        opts=options.CheckpointOptions(directory=tmp_path, attempt=1),
        rank=0,
        shared=False,
        s3=None,
        callbacks=(),
    )
    store = _Store(0, [{"steps": []}])
    assert volume_init.retire_orphans(volumes, coordinator=store) == []  # type: ignore[arg-type]
    assert store.published == []
    assert not layout.is_local_only(layout.step_dir(tmp_path, 25))
