"""The S3 tier against the real server (SeaweedFS on loopback).

Covers: 2-rank upload of every rank's files with the manifest last, and a
fresh-disk resume from S3 with equal state; SIGKILL during upload leaves no
remote manifest and resume picks the older remote step; injected 5xx and
connection resets on a share of requests still upload, with the manifest
the last object written; a manifest that cannot be written never marks the
step uploaded (and rotation keeps it); an unreachable or silent endpoint
fails within the bound with a clear error; manifest paths that escape the
step folder are refused before any download.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import socket
import threading
import time
import typing
import urllib.parse

import botocore.awsrequest
import botocore.compat
import botocore.exceptions
import ckpt_harness  # type: ignore[import-not-found]
import pytest
import torch

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import errors, events, layout, manager, options, remote, s3transport, state

pytestmark = [
    pytest.mark.s3,
    pytest.mark.filterwarnings(
        "ignore:torch.distributed is disabled:UserWarning",
        "ignore:torch.distributed is unavailable:UserWarning",
    ),
]


@pytest.mark.torch
def test_two_ranks_upload_then_resume_from_s3_on_a_fresh_disk(
    tmp_path: pathlib.Path, s3_server: typing.Any
) -> None:
    bucket = s3_server.new_bucket("ckpt-roundtrip")
    s3 = ckpt_harness.s3_cfg(s3_server, bucket)
    cfg = {"dir": str(tmp_path / "node-a"), "interval": 2, "keep_last": 2, "s3": s3}
    first = ckpt_harness.launch(
        {**cfg, "steps": 4, "dump_steps": [4]}, world=2, tmp=tmp_path, name="first"
    )
    first.wait()
    objects = ckpt_harness.bucket_keys(s3_server, bucket)
    for step in (2, 4):
        prefix = f"jobs/demo/{manifest_mod.step_dir_name(step)}/"
        names = {k[len(prefix) :] for k in objects if k.startswith(prefix)}
        local = layout.read_manifest(layout.step_dir(tmp_path / "node-a", step))
        assert {e.rank for e in local.files} == {0, 1}
        # Data objects live under the attempt-scoped data_prefix the manifest names.
        assert local.data_prefix == "a0-local"
        assert names == {local.data_key(e.path) for e in local.files} | {"manifest.json"}
        assert layout.is_uploaded(layout.step_dir(tmp_path / "node-a", step))

    resumed = ckpt_harness.launch(
        {**cfg, "dir": str(tmp_path / "node-b"), "steps": 4, "resume": True, "attempt": 1},
        world=2,
        tmp=tmp_path,
        name="resumed",
    )
    resumed.wait()
    for rank in range(2):
        assert resumed.result(rank)["restored"] == 4
        before, after = first.dump(4, rank), resumed.dump("restored", rank)
        for key, value in before["model"].items():
            assert torch.equal(value, after["model"][key]), key
        assert before["data"] == after["data"]
        assert torch.equal(before["rng_torch"], after["rng_torch"])
    # The verified download is committed locally too.
    assert layout.is_committed(layout.step_dir(tmp_path / "node-b", 4))


@pytest.mark.torch
def test_kill_during_upload_leaves_no_remote_manifest(
    tmp_path: pathlib.Path, s3_server: typing.Any
) -> None:
    bucket = s3_server.new_bucket("ckpt-kill-upload")
    s3 = ckpt_harness.s3_cfg(s3_server, bucket)
    cfg = {"dir": str(tmp_path / "node-a"), "interval": 2, "keep_last": 2, "s3": s3, "steps": 6}
    job = ckpt_harness.launch(
        cfg,
        world=2,
        tmp=tmp_path,
        name="killed",
        env={
            "CAIRN_CKPT_FAULT": "upload:1:4",
            "CAIRN_CKPT_FAULT_DIR": str(tmp_path),
            "CAIRN_CKPT_FAULT_SLEEP": "60",
        },
    )
    ckpt_harness.wait_for_file(tmp_path / "upload-1-4", job=job)
    ckpt_harness.sigkill(job, 1)
    job.kill()
    client = s3transport.make_client(options.S3Options(**s3))
    assert remote.committed_steps(client, options.S3Options(**s3)) == [2]
    assert "jobs/demo/step-000000004/a0-local/__1_0.distcp" in ckpt_harness.bucket_keys(
        s3_server, bucket
    )

    resumed = ckpt_harness.launch(
        {**cfg, "dir": str(tmp_path / "node-b"), "resume": True, "attempt": 1},
        world=2,
        tmp=tmp_path,
        name="resumed",
    )
    resumed.wait()
    assert resumed.result(0)["restored"] == 2
    assert remote.committed_steps(client, options.S3Options(**s3)) == [2, 4, 6]


class Faults:
    """Botocore hooks: 5xx and connection resets on every `every`-th request."""

    def __init__(self, *, every: int, fail_keys: str | None = None) -> None:
        self.every = every
        self.fail_keys = fail_keys
        self.counter = itertools.count(1)
        self.lock = threading.Lock()
        self.injected = 0
        self.puts: list[str] = []

    def before_send(self, request: botocore.awsrequest.AWSPreparedRequest, **_: object) -> object:
        with self.lock:
            n = next(self.counter)
        if self.fail_keys is not None and self.fail_keys in request.url:
            return self._error()
        if n % self.every != 0:
            return None
        with self.lock:
            self.injected += 1
        if n % (2 * self.every) == 0:
            raise botocore.exceptions.ConnectionClosedError(endpoint_url=request.url)
        return self._error()

    def _error(self) -> botocore.awsrequest.AWSResponse:
        body = b"<Error><Code>InternalError</Code><Message>injected</Message></Error>"
        raw = _Raw(body)
        return botocore.awsrequest.AWSResponse("http://x", 500, botocore.compat.HTTPHeaders(), raw)

    def after_call(self, http_response: typing.Any, model: typing.Any, **_: object) -> None:
        done = model.name in ("PutObject", "CompleteMultipartUpload")
        if done and http_response.status_code < 300:
            with self.lock:
                self.puts.append(urllib.parse.urlparse(http_response.url).path)


class _Raw:
    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **_: object) -> typing.Iterator[bytes]:
        yield self.body


class Trainer:
    def __init__(self, size: int = 4096) -> None:
        torch.manual_seed(0)
        # ~6 MiB with AdamW: big enough for a multipart upload at 5 MiB parts.
        self.model = torch.nn.Linear(size, 128)
        self.optim = torch.optim.AdamW(self.model.parameters())
        self.model(torch.randn(2, size)).sum().backward()
        self.optim.step()
        self.objects: dict[str, state.Stateful] = {
            "model_optim": state.ModelOptimizerState(self.model, self.optim),
        }


def single_opts(
    tmp_path: pathlib.Path, s3: dict[str, typing.Any], **kw: typing.Any
) -> options.CheckpointOptions:
    return options.CheckpointOptions(
        directory=tmp_path / "ckpt", s3=options.S3Options(**s3), interval_steps=1, **kw
    )


def test_upload_survives_injected_5xx_and_resets(
    tmp_path: pathlib.Path, s3_server: typing.Any
) -> None:
    bucket = s3_server.new_bucket("ckpt-faults")
    s3 = ckpt_harness.s3_cfg(s3_server, bucket, max_attempts=8, part_size=5 * 1024 * 1024)
    opts = single_opts(tmp_path, s3)
    client = s3transport.make_client(opts.s3)  # type: ignore[arg-type]
    faults = Faults(every=3)
    client.meta.events.register_first("before-send.s3", typing.cast(typing.Any, faults.before_send))
    client.meta.events.register("after-call.s3", faults.after_call)
    trainer = Trainer()
    with manager.CheckpointManager(opts, s3_client=client) as m:
        for step in (1, 2):
            m.save(step, trainer.objects)
        m.wait_until_finished()
    assert faults.injected >= 3
    check = s3transport.make_client(opts.s3)  # type: ignore[arg-type]
    assert remote.committed_steps(check, opts.s3) == [1, 2]  # type: ignore[arg-type]
    for step in (1, 2):
        puts = [k for k in faults.puts if f"step-{step:09d}" in k]
        assert puts[-1].endswith("/manifest.json"), puts
        manifest = layout.read_manifest(layout.step_dir(tmp_path / "ckpt", step))
        assert len(puts) == len(manifest.files) + 1  # every file once, the manifest last


@pytest.mark.parametrize("on_failure", ["Fail", "Continue"])
def test_manifest_failure_never_marks_uploaded(
    tmp_path: pathlib.Path, s3_server: typing.Any, on_failure: typing.Any
) -> None:
    bucket = s3_server.new_bucket("ckpt-nomanifest")
    s3 = ckpt_harness.s3_cfg(s3_server, bucket, max_attempts=2)
    opts = single_opts(tmp_path, s3, upload_on_failure=on_failure)
    client = s3transport.make_client(opts.s3)  # type: ignore[arg-type]
    faults = Faults(every=10**9, fail_keys="manifest.json")
    client.meta.events.register_first("before-send.s3", typing.cast(typing.Any, faults.before_send))
    trainer = Trainer(size=64)
    seen: list[events.ProgressEvent] = []
    m = manager.CheckpointManager(opts, s3_client=client, callbacks=[seen.append])
    m.save(1, trainer.objects)
    if on_failure == "Fail":
        with pytest.raises(errors.RemoteError, match="manifest"):
            m.wait_until_finished()
    else:  # training goes on; the failure is reported, the step waits in the backlog
        m.wait_until_finished()
        (failed,) = [e for e in seen if e.phase == "upload_failed"]
        assert failed.step == 1 and "manifest" in failed.message
    m.close()
    folder = layout.step_dir(tmp_path / "ckpt", 1)
    assert layout.is_committed(folder)  # committed locally...
    assert not layout.is_uploaded(folder)  # ...but never marked uploaded
    assert not any(k.endswith("manifest.json") for k in ckpt_harness.bucket_keys(s3_server, bucket))


@pytest.fixture
def silent_endpoint() -> typing.Iterator[str]:
    """A TCP endpoint that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    port = server.getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.close()


@pytest.mark.parametrize("kind", ["refused", "silent"])
def test_unreachable_endpoint_fails_within_bound(
    tmp_path: pathlib.Path, kind: str, silent_endpoint: str
) -> None:
    endpoint = (
        silent_endpoint if kind == "silent" else f"http://127.0.0.1:{ckpt_harness.free_port()}"
    )
    s3 = {
        "uri": "s3://nowhere/x",
        "endpoint_url": endpoint,
        "region": "us-east-1",
        "access_key": "a",
        "secret_key": "b",
        "max_attempts": 2,
        "connect_timeout": 1.0,
        "read_timeout": 1.0,
        "transfer_timeout": 8.0,
    }
    opts = single_opts(tmp_path, s3, upload_on_failure="Fail")
    trainer = Trainer(size=64)
    started = time.monotonic()
    m = manager.CheckpointManager(opts)
    m.save(1, trainer.objects)
    with pytest.raises(errors.RemoteError, match=endpoint.split("//")[1]):
        m.wait_until_finished()
    m.close()
    assert time.monotonic() - started < 30


def test_escaping_manifest_paths_are_refused_before_download(tmp_path: pathlib.Path) -> None:
    with pytest.raises(manifest_mod.UnsafePathError):
        remote.download_files(
            typing.cast(typing.Any, None),
            options.S3Options(uri="s3://b/p"),
            bucket="b",
            prefix="p/step-000000001",
            folder=tmp_path,
            names=["../../outside"],
        )
    assert not (tmp_path.parent / "outside").exists()
    doc = json.dumps(
        {
            "step": 1,
            "world_size": 1,
            "attempt": 0,
            "created_at": 0,
            "files": [{"path": "/abs", "size": 1, "crc32c": "00000000", "rank": 0}],
        }
    )
    with pytest.raises(ValueError, match="absolute"):
        manifest_mod.parse_manifest(doc)
