"""The upload worker and the API fence under brownouts (no S3, no API server).

Covers:
- two ranks' upload workers over one real c10d HashStore run the same rounds
  in the same order: each rank uploads its files of every committed step, a
  step is marked uploaded once, oldest first;
- a hung store holds only the upload worker: commits are noted at once while
  a round hangs, and the rounds after it upload everything;
- a drain returns once a round tried every step committed so far; `force`
  retries the whole backlog despite the backoff; a drain past its deadline
  returns False (the final checkpoint's case) and never waits on;
- a failed round is reported with the backlog (`upload_failed`), and a
  FencedError ends the worker and is raised once; the steps left at the
  final checkpoint's deadline are reported by step;
- `ApiFence` with an API server that does not answer: a local commit waits
  at most `commit_wait_seconds` and passes (the local fence decides), one
  read in flight at a time; `check_strict` raises FenceUnverifiedError; a
  stale job is still refused by both.
"""

from __future__ import annotations

import pathlib
import threading
import time
import typing

import pytest
import torch

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import coordinator, errors, events, fence, layout, options, uploader
from cairn.checkpoint import upload_backlog as backlog_mod

UID = "0123abcd-0000-4000-8000-000000000000"


def committed(root: pathlib.Path, step: int) -> None:
    folder = layout.tmp_step_dir(root, step, job_uid=None, attempt=0)
    folder.mkdir(parents=True)
    for rank in (0, 1):
        (folder / f"__{rank}_0.distcp").write_bytes(b"x" * 8)
    entries = tuple(layout.entry_for(folder, f"__{r}_0.distcp", rank=r) for r in (0, 1))
    doc = manifest_mod.Manifest(step=step, world_size=2, attempt=0, created_at=0.0, files=entries)
    layout.commit_folder(folder, layout.step_dir(root, step), doc)


class Store:
    """What the fake store saw, and a switch that makes it hang."""

    def __init__(self) -> None:
        self.uploads: list[tuple[int, int]] = []
        self.flowing = threading.Event()
        self.flowing.set()
        self.fail: type[Exception] | None = None
        self.lock = threading.Lock()

    def upload_one(self, coord: coordinator.Coordinator) -> typing.Callable[..., int]:
        def upload(*, folder: pathlib.Path, manifest: manifest_mod.Manifest, key: str) -> int:
            if not self.flowing.wait(timeout=10):
                raise errors.RemoteError("no progress for 10 s to the fake store")
            if self.fail is not None:
                raise self.fail("refused")
            with self.lock:
                self.uploads.append((coord.rank, manifest.step))
            coord.publish(f"{key}/uploaded", {"bytes": 8})
            if coord.rank == 0:
                coord.gather(f"{key}/uploaded", timeout=10)
                layout.mark_uploaded(folder)
            return 8

        return upload


def workers(
    root: pathlib.Path, store: Store, seen: list[events.ProgressEvent], *, retry: float = 0.2
) -> list[uploader.Uploader]:
    shared = torch.distributed.HashStore()  # type: ignore[attr-defined]
    opts = options.CheckpointOptions(
        directory=root, s3=options.S3Options(uri="s3://b/p"), upload_retry_seconds=retry
    )
    made = []
    for rank in (0, 1):
        coord = coordinator.StoreCoordinator(shared, rank=rank, world_size=2, namespace="t")
        backlog = backlog_mod.Backlog(opts=opts, coordinator=coord, callbacks=[seen.append])
        made.append(
            uploader.Uploader(
                backlog=backlog, coordinator=coord, upload_one=store.upload_one(coord), timeout=10
            )
        )
    return made


def drain_all(
    ranks: list[uploader.Uploader], *, force: bool = False, wait: float = 20
) -> list[bool]:
    results: list[bool] = [False, False]

    def one(index: int) -> None:
        results[index] = ranks[index].drain(deadline=time.monotonic() + wait, force=force)

    threads = [threading.Thread(target=one, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_every_rank_uploads_the_same_steps_oldest_first(tmp_path: pathlib.Path) -> None:
    store, seen = Store(), list[events.ProgressEvent]()
    committed(tmp_path, 2)  # left by an earlier attempt: the start-up round
    ranks = workers(tmp_path, store, seen)
    for worker in ranks:
        worker.start()
    committed(tmp_path, 4)
    for worker in ranks:
        worker.committed(4)
    assert drain_all(ranks) == [True, True]
    for worker in ranks:
        worker.stop(wait=5)
    assert [s for r, s in store.uploads if r == 0] == [2, 4]
    assert [s for r, s in store.uploads if r == 1] == [2, 4]
    assert all(layout.is_uploaded(layout.step_dir(tmp_path, s)) for s in (2, 4))
    assert [e.step for e in seen if e.phase == "uploaded" and e.rank == 0] == [2, 4]


def test_a_hung_store_holds_only_the_upload_worker(tmp_path: pathlib.Path) -> None:
    store, seen = Store(), list[events.ProgressEvent]()
    ranks = workers(tmp_path, store, seen)
    store.flowing.clear()  # hung: every upload blocks
    for worker in ranks:
        worker.start()
    committed(tmp_path, 2)
    for worker in ranks:
        worker.committed(2)
    # The training side goes on: more commits are noted while a round hangs
    # (were noting one to wait for the store, this would hang with it).
    for step in (4, 6, 8):
        committed(tmp_path, step)
        for worker in ranks:
            worker.committed(step)
    assert not any(layout.is_uploaded(layout.step_dir(tmp_path, s)) for s in (2, 4, 6, 8))
    store.flowing.set()
    assert drain_all(ranks, force=True) == [True, True]
    for worker in ranks:
        worker.stop(wait=5)
    assert all(layout.is_uploaded(layout.step_dir(tmp_path, s)) for s in (2, 4, 6, 8))


def test_a_failed_round_is_reported_and_retried_after_the_backoff(tmp_path: pathlib.Path) -> None:
    store, seen = Store(), list[events.ProgressEvent]()
    store.fail = errors.RemoteError
    ranks = workers(tmp_path, store, seen, retry=0.2)
    committed(tmp_path, 2)
    for worker in ranks:
        worker.start()
    assert drain_all(ranks) == [True, True]
    # One failed round at least: on a loaded machine the 0.2 s backoff may
    # already have run a second round before the drain returned.
    failed = [e for e in seen if e.phase == "upload_failed"]
    assert failed
    for event in failed:
        assert backlog_mod.parse_failure_message(event.message) == ([2], "RemoteError: refused")
    store.fail = None
    deadline = time.monotonic() + 10
    while not layout.is_uploaded(layout.step_dir(tmp_path, 2)):  # the backoff's retry round
        assert time.monotonic() < deadline, "no retry after the backoff"
        time.sleep(0.05)
    for worker in ranks:
        worker.stop(wait=5)


def test_a_drain_past_its_deadline_returns_false(tmp_path: pathlib.Path) -> None:
    store, seen = Store(), list[events.ProgressEvent]()
    store.flowing.clear()
    ranks = workers(tmp_path, store, seen)
    committed(tmp_path, 2)
    for worker in ranks:
        worker.start()
    assert drain_all(ranks, wait=0.5) == [False, False]
    store.flowing.set()
    for worker in ranks:
        worker.stop(wait=5)


def test_a_fenced_upload_ends_the_worker_and_is_raised_once(tmp_path: pathlib.Path) -> None:
    store, seen = Store(), list[events.ProgressEvent]()
    store.fail = errors.FencedError
    ranks = workers(tmp_path, store, seen)
    committed(tmp_path, 2)
    for worker in ranks:
        worker.start()
    assert drain_all(ranks) == [True, True]
    for worker in ranks:
        assert isinstance(worker.take_error(), errors.FencedError)
        assert worker.take_error() is None
        worker.stop(wait=5)


def job(attempt: int) -> dict[str, object]:
    return {"metadata": {"uid": UID}, "status": {"attempt": attempt}}


def test_api_fence_lets_a_local_commit_pass_when_the_api_server_hangs() -> None:
    answer = threading.Event()
    reads: list[float] = []

    def get_job() -> dict[str, object]:
        reads.append(time.monotonic())
        answer.wait(30)
        return job(1)

    api = fence.ApiFence(get_job=get_job, job_uid=UID, commit_wait_seconds=0.2)
    api.check(1)  # unanswered: the local fence decides
    api.check(1)
    # Both returned while the one read is still hanging (no pile-up).
    assert not answer.is_set() and len(reads) == 1
    with pytest.raises(fence.FenceUnverifiedError, match="remote commit waits"):
        fence.ApiFence(
            get_job=get_job, job_uid=UID, tries=2, backoff_seconds=0.05, read_wait_seconds=0.1
        ).check_strict(1)
    answer.set()


def test_api_fence_still_refuses_a_stale_attempt_both_ways() -> None:
    api = fence.ApiFence(get_job=lambda: job(3), job_uid=UID)
    with pytest.raises(errors.FencedError, match="attempt 3"):
        api.check(1)
    with pytest.raises(errors.FencedError, match="attempt 3"):
        fence.check_strict(fence.AllOf(fences=(api,)), 1)


def test_api_fence_answers_after_the_brownout() -> None:
    failing = [True]

    def get_job() -> dict[str, object]:
        if failing[0]:
            raise ConnectionError("refused")
        return job(1)

    api = fence.ApiFence(get_job=get_job, job_uid=UID, tries=1)
    with pytest.raises(fence.FenceUnverifiedError):
        api.check_strict(1)
    failing[0] = False
    api.check_strict(1)  # the put goes ahead once the fence can be checked


def test_steps_left_at_the_final_deadline_are_reported(tmp_path: pathlib.Path) -> None:
    seen: list[events.ProgressEvent] = []
    (rank0, _) = workers(tmp_path, Store(), seen)
    for step in (2, 4):
        committed(tmp_path, step)
    layout.mark_uploaded(layout.step_dir(tmp_path, 2))
    committed(tmp_path, 6)
    backlog = rank0._backlog
    assert backlog.report_left(6, reason="final checkpoint: grace period ended") == [4, 6]
    (failed,) = [e for e in seen if e.phase == "upload_failed"]
    assert failed.step == 6
    assert backlog_mod.parse_failure_message(failed.message) == (
        [4, 6],
        "final checkpoint: grace period ended",
    )


def test_an_uploaded_step_rotated_while_the_backlog_is_listed_is_not_planned_again(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen in the S3-brownout e2e: rotation deleted uploaded step 1328
    (manifest, then the marker with the rest) between the planner's two looks;
    the round planned it again, failed it as "no valid manifest" and held the
    other rank waiting for its copy."""
    committed(tmp_path, 2)
    committed(tmp_path, 4)
    layout.mark_uploaded(layout.step_dir(tmp_path, 2))
    classify = layout.classify

    def classify_then_rotate(folder: pathlib.Path, **kw: typing.Any) -> str:
        verdict = classify(folder, **kw)
        if folder.name == layout.step_dir(tmp_path, 2).name:
            layout.delete_step(folder)  # the writer thread's rotation, just now
        return verdict

    monkeypatch.setattr(layout, "classify", classify_then_rotate)
    assert backlog_mod.pending_steps(tmp_path, job_uid=None) == [4]


def test_a_follower_stops_waiting_for_its_copy_once_rank_0_ended_the_step(
    tmp_path: pathlib.Path,
) -> None:
    """Rank 0 failed (or saw gone) a planned step: the other rank does not wait
    its whole timeout for a copy that will not be uploaded this round."""
    store, seen = Store(), list[events.ProgressEvent]()
    rank0, rank1 = workers(tmp_path, store, seen)
    rank0._coord.broadcast("upload/round-7/9/result", {"error": "CheckpointError: gone"})
    rank1._timeout = 600.0
    with pytest.raises(errors.CheckpointError, match="rank 0 ended step"):
        rank1._ready(layout.step_dir(tmp_path, 9), "upload/round-7/9")
