"""Rotation of one volume, the upload backlog's policy, the save agreement, GPU order, RNG.

Covers, on real files where files are involved:
- rotation counts the bytes PRESENT on the volume (a node-local folder holds
  one rank's files while its manifest lists all ranks'), deletes committed
  steps by policy and own partials, and never deletes foreign, unreadable or
  unknown folders; abandoned temporary folders of this job go, another job's
  stay; who rotates (rank 0 on a shared volume, every rank on its own);
- the over-budget report when not-uploaded steps exceed keepLast;
- the backlog's pure policy: backoff doubling and bounded, rounds oldest
  first, nothing while backing off; the failure message round trip;
- the save agreement `max(current steps) + 1` (pure, and two ranks' sides
  over a real c10d HashStore: steps apart, the bounded wait) and the SIGTERM
  deadline;
- `asyncMode: off` returns from save() after the commit (one process);
- GPU ordering: the staging stream waits on an event recorded on the
  compute stream at save() time (a recording stand-in for `torch.cuda`:
  there is no GPU here; the real thing runs in the `gpu` test below);
- RNG state saved without a CUDA generator loads into a template that has
  one (a GPU), and a checkpoint with one loads into a CPU template;
- the final checkpoint: a final step the loop did not save is never
  reported as saved; one that cannot commit within the grace period raises
  with the phase it got to.
"""

from __future__ import annotations

import dataclasses
import pathlib
import typing

import pytest
import torch
from torch.distributed.checkpoint import filesystem, state_dict_loader, state_dict_saver

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import (
    agreement,
    coordinator,
    faults,
    gpu,
    layout,
    manager,
    options,
    rotation,
    state,
    upload_backlog,
)
from cairn.checkpoint.errors import CheckpointError, CoordinationTimeoutError

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
    "ignore:torch.distributed is unavailable:UserWarning",
)


def committed_step(root: pathlib.Path, step: int, *, own: dict[str, int], others: int) -> None:
    """A committed step as a node-local rank 1 holds it: its own files only,
    a manifest that also lists rank 0's `others` bytes."""
    folder = layout.step_dir(root, step)
    folder.mkdir(parents=True)
    entries = []
    for name, size in own.items():
        (folder / name).write_bytes(b"x" * size)
        entries.append(layout.entry_for(folder, name, rank=1))
    entries.append(manifest_mod.FileEntry(path="__0_0.distcp", size=others, crc32c="0" * 8, rank=0))
    doc = manifest_mod.Manifest(
        step=step, world_size=2, attempt=0, created_at=0.0, files=tuple(entries)
    )
    layout.write_manifest_exclusive(folder, doc)


def test_observe_counts_the_bytes_present_on_this_volume(tmp_path: pathlib.Path) -> None:
    committed_step(tmp_path, 1, own={"__1_0.distcp": 100}, others=10_000)
    (observed,) = rotation.observe(tmp_path, job_uid=None)
    assert observed.kind == "committed"
    manifest_bytes = (tmp_path / "step-000000001" / "manifest.json").stat().st_size
    assert observed.bytes == 100 + manifest_bytes  # not the manifest's 10,100 total


def test_max_bytes_keeps_what_fits_on_this_volume(tmp_path: pathlib.Path) -> None:
    for step in (1, 2, 3):
        committed_step(tmp_path, step, own={"__1_0.distcp": 1000}, others=1_000_000)
    opts = options.CheckpointOptions(directory=tmp_path, keep_last=3, max_bytes=3500)
    result = rotation.rotate(opts, rank=1, in_flight=frozenset(), callbacks=())
    # Manifest totals (1 MB each) would keep only the newest step.
    assert result.deleted == (1,)
    assert layout.committed_steps(tmp_path) == [2, 3]


def test_rotation_never_deletes_what_is_not_provably_ours(tmp_path: pathlib.Path) -> None:
    for step in (1, 2, 3, 4):
        committed_step(tmp_path, step, own={"__1_0.distcp": 10}, others=10)
    unknown = layout.step_dir(tmp_path, 5)  # no manifest, no marker
    unknown.mkdir()
    (unknown / "__0_0.distcp").write_bytes(b"?")
    dcp_folder = layout.step_dir(tmp_path, 6)  # a plain dcp.save folder
    dcp_folder.mkdir()
    (dcp_folder / ".metadata").write_bytes(b"meta")
    newer = layout.step_dir(tmp_path, 7)  # a manifest from a newer Cairn
    newer.mkdir()
    (newer / "manifest.json").write_text('{"format_version": 99, "step": 7}')
    partial = layout.step_dir(tmp_path, 8)  # ours: the writer marker
    partial.mkdir()
    layout.write_writer_marker(partial, job_uid=None, attempt=0)
    ours_tmp = layout.tmp_step_dir(tmp_path, 9, job_uid=None, attempt=0)
    ours_tmp.mkdir()
    theirs_tmp = layout.tmp_step_dir(tmp_path, 9, job_uid="ffffffff-other", attempt=0)
    theirs_tmp.mkdir()
    opts = options.CheckpointOptions(directory=tmp_path, keep_last=2)
    result = rotation.rotate(opts, rank=0, in_flight=frozenset(), callbacks=())
    assert result.deleted == (1, 2, 8)
    assert layout.committed_steps(tmp_path) == [3, 4]
    assert set(result.kept_aside) == {5, 6, 7}
    for kept in (unknown, dcp_folder, newer, theirs_tmp):
        assert kept.exists(), kept.name
    assert not partial.exists() and not ours_tmp.exists()


def test_stale_temps_keeps_the_in_flight_write_of_this_attempt() -> None:
    temps = {
        pathlib.Path("/r/.step-000000005.tmp-local-a1"): (5, "local", 1),
        pathlib.Path("/r/.step-000000005.tmp-local-a0"): (5, "local", 0),
        pathlib.Path("/r/.step-000000004.tmp-local-a1"): (4, "local", 1),
        pathlib.Path("/r/.step-000000005.tmp-abcdef12-a1"): (5, "abcdef12", 1),
    }
    stale = rotation.stale_temps(temps, job_uid=None, attempt=1, in_flight=frozenset({5}))
    assert [p.name for p in stale] == [
        ".step-000000004.tmp-local-a1",
        ".step-000000005.tmp-local-a0",
    ]


@pytest.mark.parametrize(
    ("rank", "shared", "rotates"),
    [(0, True, True), (1, True, False), (0, False, True), (1, False, True)],
)
def test_who_rotates(rank: int, shared: bool, rotates: bool) -> None:
    assert rotation.rotates_here(rank=rank, shared=shared) is rotates


def test_not_uploaded_steps_over_keep_last_are_kept_and_reported(tmp_path: pathlib.Path) -> None:
    for step in (1, 2, 3, 4):
        committed_step(tmp_path, step, own={"__1_0.distcp": 10}, others=10)
    s3 = options.S3Options(uri="s3://bucket/prefix")
    opts = options.CheckpointOptions(directory=tmp_path, keep_last=2, s3=s3)
    result = rotation.rotate(opts, rank=1, in_flight=frozenset(), callbacks=())
    assert result.deleted == ()
    assert result.over_budget == (1, 2)
    message = rotation.over_budget_message(result, opts)
    assert "keepLast 2" in message and "[1, 2]" in message and "not uploaded yet" in message
    layout.mark_uploaded(layout.step_dir(tmp_path, 1))
    again = rotation.rotate(opts, rank=1, in_flight=frozenset(), callbacks=())
    assert again.deleted == (1,)
    assert again.over_budget == (2,)


# -- the backlog's policy ---------------------------------------------------------------


def test_backoff_doubles_and_is_bounded() -> None:
    state_ = upload_backlog.Backoff()
    assert upload_backlog.due(state_, now=0.0)
    waits = []
    for _ in range(10):
        state_ = upload_backlog.after_failure(state_, now=100.0, error="boom", initial=2.0)
        waits.append(state_.next_try - 100.0)
    assert waits[:4] == [2.0, 4.0, 8.0, 16.0]
    assert max(waits) == 2.0 * upload_backlog.MAX_BACKOFF_FACTOR
    assert not upload_backlog.due(state_, now=100.0)
    assert upload_backlog.due(state_, now=state_.next_try)
    assert state_.last_error == "boom" and state_.failures == 10


@pytest.mark.parametrize(
    ("pending", "due_now", "expected"),
    [
        ([6, 4, 2], True, [2, 4, 6]),  # oldest first
        ([6], True, [6]),
        ([], True, []),
        ([2, 4, 6], False, []),  # backing off: new steps join the backlog
        ([6, 6], True, [6]),
    ],
)
def test_plan_round(pending: list[int], due_now: bool, expected: list[int]) -> None:
    assert upload_backlog.plan_round(pending=pending, due_now=due_now) == expected


def test_failure_message_round_trip() -> None:
    message = upload_backlog._failure_message("RemoteError: connection reset", [4, 6])
    assert upload_backlog.parse_failure_message(message) == (
        [4, 6],
        "RemoteError: connection reset",
    )
    assert upload_backlog.parse_failure_message("plain") == ([], "plain")


def test_pending_steps_are_committed_and_not_uploaded(tmp_path: pathlib.Path) -> None:
    for step in (1, 2, 3):
        committed_step(tmp_path, step, own={"__1_0.distcp": 1}, others=1)
    layout.mark_uploaded(layout.step_dir(tmp_path, 2))
    assert upload_backlog.pending_steps(tmp_path, job_uid=None) == [1, 3]


# -- the save agreement and the SIGTERM deadline -----------------------------------------


@pytest.mark.parametrize(
    ("steps", "agreed"), [([10, 7], 11), ([7, 10, 9], 11), ([5, 5], 6), ([3], 3)]
)
def test_agreed_step_is_one_past_the_furthest_rank(steps: list[int], agreed: int) -> None:
    assert agreement.agreed_step(steps) == agreed


@pytest.mark.parametrize(
    ("grace", "deadline"),
    [(None, 100.0 + 600.0), (300.0, 100.0 + 270.0), (30.0, 100.0 + 25.0), (2.0, 100.0)],
)
def test_final_deadline_is_the_grace_minus_a_margin(grace: float | None, deadline: float) -> None:
    assert agreement.final_deadline(signalled_at=100.0, grace=grace, timeout=600.0) == deadline


class Trainer:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 2)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=0.1)
        self.objects: dict[str, state.Stateful] = {
            "model_optim": state.ModelOptimizerState(self.model, self.optim),
            "rng": state.RNGState(),
        }

    def step(self) -> None:
        self.model(torch.randn(3, 4)).square().mean().backward()
        self.optim.step()
        self.optim.zero_grad()


def test_async_off_save_returns_after_the_commit(tmp_path: pathlib.Path) -> None:
    trainer = Trainer()
    opts = options.CheckpointOptions(directory=tmp_path, async_mode="off", interval_steps=1)
    with manager.CheckpointManager(opts) as m:
        for step in (1, 2, 3):
            trainer.step()
            assert m.save(step, trainer.objects)
            assert layout.is_committed(layout.step_dir(tmp_path, step))


@pytest.mark.parametrize("mode", ["thread", "pinned"])
def test_async_modes_commit_the_values_of_the_save_step(
    tmp_path: pathlib.Path, mode: typing.Any
) -> None:
    trainer = Trainer()
    opts = options.CheckpointOptions(directory=tmp_path, async_mode=mode, interval_steps=1)
    with manager.CheckpointManager(opts) as m:
        trainer.step()
        expected = trainer.model.weight.detach().clone()
        m.save(1, trainer.objects)
        m.wait_until_staged()
        trainer.step()  # changes the weights while the write may still run
        m.wait_until_finished()
    loaded = {"model_optim": {"model": {"weight": torch.zeros(2, 4), "bias": torch.zeros(2)}}}
    state_dict_loader.load(loaded, checkpoint_id=layout.step_dir(tmp_path, 1), no_dist=True)
    assert torch.equal(loaded["model_optim"]["model"]["weight"], expected)


def test_make_stager_per_mode() -> None:
    assert manager.make_stager("off", cuda=False) is None
    for mode in ("thread", "pinned"):
        stager = manager.make_stager(mode, cuda=False)
        assert stager is not None
        stager.close()


# -- GPU ordering -------------------------------------------------------------------------


@dataclasses.dataclass
class Recorder:
    """Stands in for `torch.cuda` and its streams/events: records the calls."""

    available: bool = True
    calls: list[tuple[str, object]] = dataclasses.field(default_factory=list)

    def is_available(self) -> bool:
        return self.available

    def current_stream(self) -> str:
        return "compute"

    def Event(self) -> Recorder.FakeEvent:  # noqa: N802
        return Recorder.FakeEvent(self)

    class FakeEvent:
        def __init__(self, owner: Recorder) -> None:
            self.owner = owner

        def record(self, stream: object = None) -> None:
            self.owner.calls.append(("record", stream))

    class FakeStream:
        def __init__(self, owner: Recorder) -> None:
            self.owner = owner

        def wait_event(self, event: object) -> None:
            self.owner.calls.append(("wait_event", event))


def test_staging_stream_waits_on_an_event_of_the_compute_stream() -> None:
    cuda = Recorder()
    stream = Recorder.FakeStream(cuda)
    event = gpu.order_after_compute(stream=stream, cuda=cuda)
    assert cuda.calls == [("record", "compute"), ("wait_event", event)]


def test_no_ordering_without_gpu_or_staging_stream() -> None:
    cuda = Recorder(available=False)
    assert gpu.order_after_compute(stream=Recorder.FakeStream(cuda), cuda=cuda) is None
    assert gpu.order_after_compute(stream=None, cuda=Recorder()) is None
    assert cuda.calls == []


def test_staging_stream_of_the_default_stager() -> None:
    stager = manager.make_stager("pinned", cuda=torch.cuda.is_available())
    assert stager is not None
    try:
        stream = gpu.staging_stream(stager)
        # torch creates the staging stream only with an accelerator.
        assert (stream is not None) == torch.accelerator.is_available()
    finally:
        stager.close()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine "
    "(runs wherever CUDA is present, e.g. the device machine)",
)
def test_gpu_staging_copy_sees_the_update_queued_before_save(tmp_path: pathlib.Path) -> None:
    """On a GPU: a long kernel queued right before save() must be in the snapshot."""
    model = torch.nn.Linear(4096, 4096, device="cuda")
    optim = torch.optim.SGD(model.parameters(), lr=1.0)
    objects: dict[str, state.Stateful] = {"model_optim": state.ModelOptimizerState(model, optim)}
    opts = options.CheckpointOptions(directory=tmp_path, async_mode="pinned", interval_steps=1)
    with manager.CheckpointManager(opts) as m:
        with torch.no_grad():
            for _ in range(50):  # queue lots of work on the compute stream
                model.weight.mul_(1.0001)
            model.weight.fill_(7.0)
        m.save(1, objects)  # no synchronize: ordering must come from the event
        m.wait_until_staged()
        with torch.no_grad():
            model.weight.fill_(-1.0)
        m.wait_until_finished()
    loaded = {
        "model_optim": {"model": {"weight": torch.zeros(4096, 4096), "bias": torch.zeros(4096)}}
    }
    state_dict_loader.load(loaded, checkpoint_id=layout.step_dir(tmp_path, 1), no_dist=True)
    assert bool((loaded["model_optim"]["model"]["weight"] == 7.0).all())


# -- RNG across devices ---------------------------------------------------------------


def save_rng(folder: pathlib.Path, sd: dict[str, typing.Any]) -> None:
    state_dict_saver.save(
        {"rng/rank-0": sd}, storage_writer=filesystem.FileSystemWriter(folder), no_dist=True
    )


def test_rng_saved_on_cpu_loads_into_a_gpu_template(tmp_path: pathlib.Path) -> None:
    rng = state.RNGState()
    saved = rng.state_dict()
    assert "cuda" not in saved or torch.cuda.is_available()
    saved.pop("cuda", None)  # what a CPU rank writes
    save_rng(tmp_path / "ckpt", saved)
    expected = torch.rand(3)  # the draw right after the save
    # What a GPU rank asks for: its state has a CUDA generator entry.
    template = {"rng/rank-0": {**rng.state_dict(), "cuda": torch.zeros(16, dtype=torch.uint8)}}
    present = state.checkpoint_keys(tmp_path / "ckpt")
    dropped = state.drop_absent_optional(template, key="rng/rank-0", obj=rng, present=present)
    assert dropped == ["cuda"]
    state_dict_loader.load(template, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    rng.load_state_dict(template["rng/rank-0"])
    assert torch.equal(torch.rand(3), expected)


def test_rng_saved_on_gpu_loads_into_a_cpu_template(tmp_path: pathlib.Path) -> None:
    rng = state.RNGState()
    saved = {**rng.state_dict(), "cuda": torch.arange(16, dtype=torch.uint8)}  # a GPU rank's
    save_rng(tmp_path / "ckpt", saved)
    expected = torch.rand(3)
    template = {"rng/rank-0": {k: v for k, v in rng.state_dict().items() if k != "cuda"}}
    present = state.checkpoint_keys(tmp_path / "ckpt")
    assert state.drop_absent_optional(template, key="rng/rank-0", obj=rng, present=present) == []
    state_dict_loader.load(template, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    rng.load_state_dict(template["rng/rank-0"])
    assert torch.equal(torch.rand(3), expected)


# -- the final (SIGTERM) checkpoint ------------------------------------------------------


def test_a_final_step_that_was_not_saved_is_never_reported(tmp_path: pathlib.Path) -> None:
    trainer = Trainer()
    opts = options.CheckpointOptions(directory=tmp_path, interval_steps=100)
    with manager.CheckpointManager(opts) as m:
        trainer.step()
        m.request_final_checkpoint()
        assert m.should_save(1)  # agreed: step 1 (one process)
        # The loop "forgets" to save: reached_final must not claim it.
        with pytest.raises(CheckpointError, match="final checkpoint step 1 was not saved"):
            m.reached_final(1)
    assert layout.committed_steps(tmp_path) == []


def test_a_final_step_that_cannot_commit_in_the_grace_period_says_why(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The write stalls (fault pause point) longer than the grace allows.
    monkeypatch.setenv(faults.ENV_FAULT, "write:0:1")
    monkeypatch.setenv(faults.ENV_FAULT_DIR, str(tmp_path))
    monkeypatch.setenv(faults.ENV_FAULT_SLEEP, "8")
    trainer = Trainer()
    opts = options.CheckpointOptions(
        directory=tmp_path / "ckpt", interval_steps=100, final_grace_seconds=6.0
    )
    m = manager.CheckpointManager(opts)
    trainer.step()
    m.request_final_checkpoint()
    assert m.save(1, trainer.objects)
    with pytest.raises(CheckpointError, match="did not commit within the grace period") as info:
        m.reached_final(1)
    assert "last finished phase on rank 0: staged" in str(info.value)
    m.close()  # the stalled write goes on and commits later
    assert layout.committed_steps(tmp_path / "ckpt") == [1]


def two_ranks() -> list[agreement.Agreement]:
    """Two ranks' sides of the protocol over one real c10d store."""
    store = torch.distributed.HashStore()  # type: ignore[attr-defined]
    return [
        agreement.Agreement(
            coordinator.StoreCoordinator(store, rank=r, world_size=2, namespace="t"),
            timeout=5.0,
            grace=None,
        )
        for r in (0, 1)
    ]


def test_ranks_steps_apart_agree_on_one_past_the_furthest() -> None:
    behind, ahead = two_ranks()
    ahead.request(final=True)  # SIGTERM on the rank that is ahead, at its step 6
    ahead.agree(6)  # reports 6; does not wait (step 6 cannot be the agreed one)
    assert ahead.final_step is None and ahead.pending()
    behind.poll()
    behind.agree(3)  # the rank behind sees it at its step 3, reports 3
    assert behind.final_step == 7
    ahead.agree(7)  # at its report + 1 the ahead rank must know: it does
    assert ahead.final_step == 7
    assert ahead.requested == behind.requested == {7}
    assert not ahead.pending() and not behind.pending()


def test_a_rank_at_its_report_plus_one_waits_for_the_others_bounded() -> None:
    store = torch.distributed.HashStore()  # type: ignore[attr-defined]
    alone = agreement.Agreement(
        coordinator.StoreCoordinator(store, rank=0, world_size=2, namespace="t"),
        timeout=0.2,
        grace=None,
    )
    alone.request(final=False)
    alone.agree(4)  # reports; no wait yet
    with pytest.raises(CoordinationTimeoutError):
        alone.agree(5)  # the other rank never reports


def test_an_uploaded_copy_deleted_from_outside_is_not_a_worker_failure(
    tmp_path: pathlib.Path,
) -> None:
    """Node-local rank != 0 marks its copy after rank 0's verdict; a folder that
    someone deleted meanwhile is logged, not raised (the upload worker would die)."""
    present = tmp_path / "step-000000004"
    present.mkdir()
    assert upload_backlog.mark_copy_uploaded(present, rank=1, step=4)
    assert layout.is_uploaded(present)
    gone = tmp_path / "step-000000008"
    assert not upload_backlog.mark_copy_uploaded(gone, rank=1, step=8)
    assert not gone.exists()  # nothing recreated
