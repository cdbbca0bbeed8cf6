"""Storage brownouts never stall training: real gloo ranks, real S3 behind a TCP proxy.

Covers (`tcp_hold_proxy.HoldProxy` between the ranks and the real S3 server:
it throttles, or holds connections open without forwarding, as a SIGSTOPped
server does):
- a throttled store (64 KiB/s) is slow, not hung: no watchdog, uploads go on;
- a hung store: saves keep committing locally at the training rate measured
  before the hang (same run, ratio), the watchdog reports "no progress for
  N s to <endpoint>" as an upload failure, and once the proxy forwards again
  every saved step is uploaded and marked so; no rank fails;
- one transfer on its own: an upload to a hung store fails with the
  watchdog's reason (RemoteError), a download fails with StallError
  (transient) and, in `retrying`, with TransportError, both bounded;
  a small request (the manifest GET) likewise;
- start-up and restore reads of a hung store (the remote-step listing, the
  lineage reads of the first save, the prefix-owner check) give up within
  about 3 x stall_seconds with the reason, never hang.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import time
import typing

import ckpt_harness  # type: ignore[import-not-found]
import pytest
import tcp_hold_proxy  # type: ignore[import-not-found]

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import errors, layout, lineage, options, remote, s3transport

STALL = 3.0
"""The tests' stall_seconds (the API's minimum is 5; the library takes any > 0)."""


def _steps_reached(out: pathlib.Path, world: int) -> int:
    reached = []
    for rank in range(world):
        path = out / f"step.{rank}"
        reached.append(int(path.read_text() or 0) if path.exists() else 0)
    return min(reached)


def _wait(predicate: typing.Callable[[], bool], *, job: ckpt_harness.Job, what: str) -> None:
    deadline = time.monotonic() + 120
    while not predicate():
        if any(p.poll() is not None for p in job.procs):
            raise AssertionError(f"a rank exited while waiting for {what}\n{job.tail()}")
        if time.monotonic() > deadline:
            job.kill()
            raise AssertionError(f"{what}: not within 120 s\n{job.tail()}")
        time.sleep(0.1)


def _rate(times: dict[str, float], start: float, end: float) -> float:
    """Training steps per second between two wall-clock times (the rank's own log)."""
    inside = [t for t in times.values() if start <= t <= end]
    return len(inside) / (end - start)


def test_hung_store_never_holds_a_save(tmp_path: pathlib.Path, s3_server: typing.Any) -> None:
    bucket = s3_server.new_bucket("ckpt-brownout")
    with tcp_hold_proxy.HoldProxy(s3_server.endpoint_url) as proxy:
        s3 = ckpt_harness.s3_cfg(s3_server, bucket, stall_seconds=STALL, max_attempts=2)
        s3["endpoint_url"] = endpoint = proxy.endpoint_url
        cfg = {
            "dir": str(tmp_path / "ckpt"),
            "steps": 300,
            "interval": 2,
            "keep_last": 3,
            "sleep_per_step": 0.08,
            "upload_retry": 0.5,
            "s3": s3,
            "step_file": str(tmp_path / "run" / "step"),
        }
        job = ckpt_harness.launch(cfg, world=2, tmp=tmp_path, name="run")
        out = job.out
        try:
            _wait(lambda: _steps_reached(out, 2) >= 20, job=job, what="step 20")
            proxy.throttle(64 * 1024)  # slow, not hung: the watchdog stays quiet
            throttled = time.time()
            _wait(lambda: _steps_reached(out, 2) >= 60, job=job, what="step 60")
            proxy.hold()
            held = time.time()
            logs = [out / "log-rank0.txt"]
            _wait(
                lambda: any("no progress for" in p.read_text(errors="replace") for p in logs),
                job=job,
                what="the watchdog's report",
            )
            # Hold on past one more stall, so saves commit during a known hang.
            reached = _steps_reached(out, 2)
            _wait(lambda: _steps_reached(out, 2) >= reached + 40, job=job, what="40 more steps")
            proxy.release()
            released = time.time()
            job.wait()
        finally:
            proxy.release()
            job.kill()
    results = [json.loads((out / f"result-rank{r}.json").read_text()) for r in range(2)]
    times = results[0]["step_times"]
    before = _rate(times, throttled - 4.0, throttled)
    during_throttle = _rate(times, throttled, held)
    during_hold = _rate(times, held, released)
    print(
        f"BROWNOUT-NUMBERS steps/s before {before:.2f}, throttled {during_throttle:.2f}, "
        f"hung {during_hold:.2f} (hang {released - held:.1f} s)"
    )
    assert during_throttle >= 0.8 * before, (before, during_throttle)
    assert during_hold >= 0.8 * before, (before, during_hold)

    events = results[0]["events"]
    failed = [e for e in events if e["phase"] == "upload_failed"]
    assert failed, "the hang was never reported"
    assert all(e["time"] >= held for e in failed), "the throttled store was reported as failing"
    reason = f"no progress for {STALL:.0f} s to {endpoint}"
    assert any(reason in e["message"] for e in failed), [e["message"] for e in failed]
    committed_in_hang = [
        e["step"] for e in events if e["phase"] == "committed" and held < e["time"] < released
    ]
    assert len(committed_in_hang) >= 5, committed_in_hang  # saves went on during the hang
    # Retention kept the steps not uploaded past keepLast, and said so.
    kept = [e["message"] for e in events if e["phase"] == "rotated" and e["message"]]
    assert any("not uploaded yet" in m for m in kept), kept[-3:]

    # Afterwards every saved step is in the bucket (manifest last) and kept
    # local steps carry the uploaded marker.
    saved = results[0]["saved"]
    direct = options.S3Options(**{**s3, "endpoint_url": s3_server.endpoint_url})
    in_bucket = remote.committed_steps(s3_server.client(), direct)
    assert set(saved) <= set(in_bucket), sorted(set(saved) - set(in_bucket))
    for step in results[0]["all_steps"]:
        assert layout.is_uploaded(layout.step_dir(tmp_path / "ckpt", step)), step


@pytest.fixture
def held_store(s3_server: typing.Any) -> typing.Iterator[tuple[options.S3Options, str]]:
    """A bucket with one object, behind a proxy that holds every connection."""
    bucket = s3_server.new_bucket("ckpt-hung-transfer")
    s3_server.client().put_object(Bucket=bucket, Key="p/step-000000001/blob", Body=b"x" * 4096)
    with tcp_hold_proxy.HoldProxy(s3_server.endpoint_url) as proxy:
        opts = options.S3Options(
            uri=f"s3://{bucket}/p",
            endpoint_url=proxy.endpoint_url,
            region=s3_server.region,
            access_key=s3_server.access_key,
            secret_key=s3_server.secret_key,
            max_attempts=2,
            stall_seconds=STALL,
        )
        proxy.hold()
        try:
            yield opts, proxy.endpoint_url
        finally:
            proxy.release()


def test_upload_to_a_hung_store_fails_with_the_watchdogs_reason(
    tmp_path: pathlib.Path, held_store: tuple[options.S3Options, str]
) -> None:
    opts, endpoint = held_store
    (tmp_path / "data").write_bytes(b"y" * 100_000)
    entry = layout.entry_for(tmp_path, "data", rank=0)
    manifest = manifest_mod.Manifest(
        step=1, world_size=1, attempt=0, created_at=0.0, files=(entry,), versions={}
    )
    started = time.monotonic()
    with pytest.raises(errors.RemoteError, match=f"no progress for 3 s to {endpoint}"):
        remote.upload_files(
            s3transport.make_client(opts), opts, folder=tmp_path, manifest=manifest, entries=[entry]
        )
    # Bounded by the watchdog, not by read_timeout x attempts (60 s here).
    assert time.monotonic() - started < STALL + 20


def test_download_from_a_hung_store_is_a_transport_error(
    tmp_path: pathlib.Path, held_store: tuple[options.S3Options, str]
) -> None:
    opts, _ = held_store
    client = s3transport.make_client(opts)
    started = time.monotonic()
    with pytest.raises(s3transport.StallError, match="no progress for 3 s"):
        remote.download_files(
            client,
            opts,
            bucket=opts.bucket,
            prefix="p/step-000000001",
            folder=tmp_path,
            names=["blob"],
        )
    assert s3transport.is_transient(s3transport.StallError("x"))
    with pytest.raises(errors.TransportError, match="transport kept failing"):
        s3transport.retrying(
            lambda: remote.get_bytes_or_none(
                client, opts.bucket, "p/step-000000001/blob", within=opts.stall_seconds
            ),
            what="reading the manifest",
            backoff=s3transport.Backoff(rounds=2, first_seconds=0.1),
        )
    # Two bounded reads and one download, each cut at the stall bound.
    assert time.monotonic() - started < 3 * STALL + 30


# Start-up and restore reads of a hung store: each request waits at most
# stall_seconds, `retrying` runs 3 rounds (waits 1 s and 2 s between), so a
# whole read gives up after about 3 x READ_STALL + 3 s with the reason, never
# after botocore's read_timeout x max_attempts per request.
READ_STALL = 1.0
"""stall_seconds of these reads: small, each test waits for three rounds of it."""
READ_BOUND = 3 * READ_STALL + 3 + 15
"""A whole bounded read of a hung store, with slack for a loaded machine."""


def _read_opts(held: tuple[options.S3Options, str]) -> options.S3Options:
    return dataclasses.replace(held[0], stall_seconds=READ_STALL)


def test_listing_a_hung_store_is_a_transport_error(
    held_store: tuple[options.S3Options, str],
) -> None:
    opts = _read_opts(held_store)
    client = s3transport.make_client(opts)
    started = time.monotonic()
    with pytest.raises(errors.TransportError, match="no answer for 1 s"):
        s3transport.retrying(
            lambda: remote.committed_steps(client, opts), what="listing remote steps"
        )
    assert time.monotonic() - started < READ_BOUND
    started = time.monotonic()
    with pytest.raises(s3transport.StallError, match="listing s3://"):
        remote.list_sizes(client, opts.bucket, "p", within=opts.stall_seconds)
    assert time.monotonic() - started < READ_STALL + 15


def test_lineage_reads_of_a_hung_store_fail_bounded(
    held_store: tuple[options.S3Options, str],
) -> None:
    """The first save's lineage decision reads S3; a RemoteError there makes it
    decide from the volume (`lineage.begin`), so it must come, and soon."""
    opts = _read_opts(held_store)
    client = s3transport.make_client(opts)
    for read in (
        lambda: lineage.own_remote_steps(client, opts, job_uid="job-uid"),
        lambda: lineage.read_remote_record(client, opts),
    ):
        started = time.monotonic()
        with pytest.raises(errors.RemoteError, match="no answer for 1 s"):
            read()
        assert time.monotonic() - started < READ_BOUND


def test_prefix_owner_check_of_a_hung_store_is_bounded_and_logged(
    held_store: tuple[options.S3Options, str], caplog: pytest.LogCaptureFixture
) -> None:
    """An unreachable store never stops a start: the check gives up, bounded, saying why."""
    opts = _read_opts(held_store)
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="cairn.checkpoint"):
        remote.check_prefix_owner(s3transport.make_client(opts), opts, job_uid="job-uid")
    assert time.monotonic() - started < READ_BOUND
    warned = [r.getMessage() for r in caplog.records if "prefix owner" in r.getMessage()]
    assert warned and "no answer for 1 s" in warned[-1], warned
