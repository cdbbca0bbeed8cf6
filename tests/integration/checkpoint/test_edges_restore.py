"""Restore at the edges: real files, real gloo ranks, the real S3 server.

Covers, each a named case:
- one rank's EACCES on a step's files never deletes the step (resume falls
  back, the step's bytes survive untouched, nothing is quarantined);
- a step with a newer-format manifest and a plain DCP folder named like a
  step survive start-up and restore byte for byte, and neither is loaded;
- transient S3 faults (503 SlowDown, 500, connection resets, truncated
  bodies, through a loopback proxy in front of the real server) during
  restore's manifest GETs and downloads do not fall back: the newest step
  loads, bit-identical;
- fresh node-local volumes: every rank downloads the whole step from S3 and
  installs it on its own volume (committed, marked uploaded);
- resume.uri naming another job's Cairn step folder downloads, verifies and
  loads it (imported), without making it one of this job's steps;
- an S3 outage during restore fails the restore (TransportError) instead of
  falling back to an older step; nothing is quarantined or installed;
- a CRC-corrupt step (local and S3 copy) is quarantined, not deleted, and
  resume falls back to the previous step;
- a plain DCP folder on the volume named by resume.step is imported (model,
  optimizer, step) by each documented key rule, and left untouched; one
  that does not fit the model, or an explicit step of a newer manifest
  format, is a ConfigurationError and the folder is kept as it was;
- a TorchTitan-layout checkpoint written by plain `dcp.save` resumes the
  reference trainer (2 ranks, torchrun) via resume.uri with its weights;
- garbage at resume.uri (and other deterministic start-up failures) makes
  the reference trainer exit 78 with the reason in the termination message.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import typing

import ckpt_harness  # type: ignore[import-not-found]
import pytest
import s3_fault_proxy  # type: ignore[import-not-found]
import torch
from torch.distributed.checkpoint import state_dict as dcp_state_dict
from torch.distributed.checkpoint import state_dict_saver

from cairn.api import exitcodes
from cairn.api import manifest as manifest_mod
from cairn.checkpoint import errors, foreign, layout, manager, options, remote, state
from cairn.trainer import data, model

pytestmark = [
    pytest.mark.torch,
    pytest.mark.filterwarnings(
        "ignore:torch.distributed is disabled:UserWarning",
        "ignore:torch.distributed is unavailable:UserWarning",
    ),
]

# Rank 1 without the capabilities that let root read any file: a chmod 000
# file then fails with EACCES there, as it would for an unprivileged user.
NO_DAC = [
    "setpriv",
    "--inh-caps=-dac_override,-dac_read_search",
    "--bounding-set=-dac_override,-dac_read_search",
]


def snapshot(folder: pathlib.Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def copies_of(root: pathlib.Path, name: str) -> list[pathlib.Path]:
    """Every folder called `name` under root (in place or moved aside)."""
    return sorted(p for p in root.rglob(name) if p.is_dir())


def flip_byte(data: bytes) -> bytes:
    changed = bytearray(data)
    changed[len(changed) // 2] ^= 0xFF  # same size: only the CRC sees it
    return bytes(changed)


def wait_all(job: typing.Any, timeout: float = 180.0) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for proc in job.procs:
        try:
            codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            job.kill()
            raise AssertionError(f"a rank did not exit in {timeout}s\n{job.tail()}") from None
    return codes


# -- unreadable is not garbage ---------------------------------------------------------


def test_one_rank_eacces_never_deletes_a_step(tmp_path: pathlib.Path) -> None:
    ckpt = tmp_path / "ckpt"
    cfg = {"interval": 2, "keep_last": 3, "steps": 6, "dir": str(ckpt)}
    ckpt_harness.launch(cfg, world=2, tmp=tmp_path, name="first").wait()
    assert layout.committed_steps(ckpt) == [2, 4, 6]
    folder = layout.step_dir(ckpt, 6)
    before = snapshot(folder)
    for shard in folder.glob("*.distcp"):
        shard.chmod(0)
    try:
        resumed = ckpt_harness.launch(
            {**cfg, "steps": 4, "resume": True, "attempt": 1},
            world=2,
            tmp=tmp_path,
            name="resumed",
            prefix={1: NO_DAC},
        )
        resumed.wait()
    finally:
        for shard in ckpt.rglob("*.distcp"):
            shard.chmod(0o644)
    for rank in range(2):
        assert resumed.result(rank)["restored"] == 4
        assert resumed.result(rank)["skipped"] == [6]
    # The step's bytes are all still there (in place, or moved aside as the
    # superseded branch of the new lineage), never quarantined or deleted.
    survivors = copies_of(ckpt, folder.name)
    assert len(survivors) == 1, survivors
    assert snapshot(survivors[0]) == before
    assert "quarantine" not in survivors[0].parts
    log = resumed.logs[0].read_text()
    assert "unreadable" in log
    assert "Permission denied" in log


def test_newer_format_manifest_and_foreign_dcp_folder_survive_restore_and_startup(
    tmp_path: pathlib.Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    cfg = {"interval": 2, "keep_last": 3, "steps": 4, "dir": str(ckpt)}
    ckpt_harness.launch(cfg, world=2, tmp=tmp_path, name="first").wait()
    # Step 6 as a newer Cairn would write it: a major format bump.
    newer = layout.step_dir(ckpt, 6)
    shutil.copytree(layout.step_dir(ckpt, 4), newer)
    doc = json.loads((newer / manifest_mod.MANIFEST_NAME).read_text())
    doc.update(format_version=manifest_mod.FORMAT_VERSION + 1, step=6, new_field={"x": 1})
    (newer / manifest_mod.MANIFEST_NAME).write_text(json.dumps(doc))
    # Step 7: a plain DCP checkpoint (dcp.save, no manifest) named like a step.
    plain = layout.step_dir(ckpt, 7)
    state_dict_saver.save({"model": {"w": torch.arange(8.0)}}, checkpoint_id=plain, no_dist=True)
    before = {newer: snapshot(newer), plain: snapshot(plain)}

    resumed = ckpt_harness.launch(
        {**cfg, "resume": True, "attempt": 1}, world=2, tmp=tmp_path, name="resumed"
    )
    resumed.wait()
    for rank in range(2):
        assert resumed.result(rank)["restored"] == 4  # the newest step this Cairn can read
    for folder, content in before.items():
        assert snapshot(folder) == content, folder


# -- transport is not verification ------------------------------------------------------


@pytest.mark.s3
def test_transient_s3_errors_during_restore_do_not_fall_back(
    tmp_path: pathlib.Path, s3_server: typing.Any
) -> None:
    bucket = s3_server.new_bucket("edges-transient")
    s3 = ckpt_harness.s3_cfg(s3_server, bucket)
    cfg = {"interval": 2, "keep_last": 2, "steps": 4, "s3": s3}
    first = ckpt_harness.launch(
        {**cfg, "dir": str(tmp_path / "node-a"), "dump_steps": [4]},
        world=2,
        tmp=tmp_path,
        name="first",
    )
    first.wait()
    with s3_fault_proxy.FaultProxy(
        s3_server.endpoint_url, match="/step-000000004/", fail_first=8
    ) as proxy:
        resumed = ckpt_harness.launch(
            {
                **cfg,
                "dir": str(tmp_path / "node-b"),  # a fresh disk: everything from S3
                "resume": True,
                "attempt": 1,
                "s3": {**s3, "endpoint_url": proxy.endpoint_url},
            },
            world=2,
            tmp=tmp_path,
            name="resumed",
        )
        resumed.wait(timeout=240)
    assert len(proxy.injected) == 8
    assert set(proxy.injected) == {"503", "500", "reset", "truncate"}
    for rank in range(2):
        assert resumed.result(rank)["restored"] == 4
        assert resumed.result(rank)["skipped"] == []
        expected = first.dump(4, rank)
        got = resumed.dump("restored", rank)
        for name, tensor in expected["model"].items():
            assert torch.equal(got["model"][name], tensor), name
    assert not (tmp_path / "node-b" / ".cairn" / "quarantine").exists()
    assert remote.committed_steps(s3_server.client(), options.S3Options(**s3)) == [2, 4]


@pytest.mark.s3
def test_node_local_ranks_each_restore_and_install_the_step_from_s3(
    tmp_path: pathlib.Path, s3_server: typing.Any
) -> None:
    bucket = s3_server.new_bucket("edges-node-local")
    s3 = ckpt_harness.s3_cfg(s3_server, bucket)
    cfg = {"interval": 2, "keep_last": 2, "steps": 4, "s3": s3}
    first = ckpt_harness.launch(
        {**cfg, "dir": str(tmp_path / "first-{rank}"), "dump_steps": [4]},
        world=2,
        tmp=tmp_path,
        name="first",
    )
    first.wait()
    # Fresh node-local volumes (one per rank): every rank downloads the whole step.
    resumed = ckpt_harness.launch(
        {**cfg, "dir": str(tmp_path / "fresh-{rank}"), "resume": True, "attempt": 1},
        world=2,
        tmp=tmp_path,
        name="resumed",
    )
    resumed.wait()
    for rank in range(2):
        assert resumed.result(rank)["restored"] == 4
        expected, got = first.dump(4, rank), resumed.dump("restored", rank)
        for name, tensor in expected["model"].items():
            assert torch.equal(got["model"][name], tensor), name
        volume = tmp_path / f"fresh-{rank}"
        # Installed on this rank's own volume: committed, marked uploaded, no temporary left.
        assert 4 in layout.committed_steps(volume)
        assert layout.is_uploaded(layout.step_dir(volume, 4))
        assert layout.tmp_dirs(volume) == {}


@pytest.mark.s3
def test_resume_uri_naming_another_jobs_cairn_step_loads_it_verified(
    tmp_path: pathlib.Path, s3_server: typing.Any
) -> None:
    bucket = s3_server.new_bucket("edges-uri-cairn")
    other = ckpt_harness.s3_cfg(s3_server, bucket, uri=f"s3://{bucket}/jobs/other")
    first = ckpt_harness.launch(
        {"interval": 2, "steps": 4, "s3": other, "dir": str(tmp_path / "a"), "dump_steps": [4]},
        world=2,
        tmp=tmp_path,
        name="first",
    )
    first.wait()
    mine = ckpt_harness.s3_cfg(s3_server, bucket)  # this job's own prefix: jobs/demo
    resumed = ckpt_harness.launch(
        {
            "interval": 2,
            "steps": 4,
            "s3": mine,
            "dir": str(tmp_path / "b"),
            "resume": True,
            "resume_uri": f"s3://{bucket}/jobs/other/step-000000004",
            "attempt": 1,
        },
        world=2,
        tmp=tmp_path,
        name="resumed",
    )
    resumed.wait()
    for rank in range(2):
        assert resumed.result(rank)["restored"] == 4
        assert resumed.result(rank)["imported"] is True
        expected, got = first.dump(4, rank), resumed.dump("restored", rank)
        for name, tensor in expected["model"].items():
            assert torch.equal(got["model"][name], tensor), name
    # Not one of this job's steps: nothing installed, no download left behind.
    assert layout.committed_steps(tmp_path / "b") == []
    assert layout.tmp_dirs(tmp_path / "b") == {}
    assert remote.committed_steps(s3_server.client(), options.S3Options(**mine)) == []


@pytest.mark.s3
def test_s3_outage_during_restore_fails_instead_of_falling_back(
    tmp_path: pathlib.Path, s3_server: typing.Any
) -> None:
    bucket = s3_server.new_bucket("edges-outage")
    s3 = ckpt_harness.s3_cfg(s3_server, bucket, max_attempts=2)
    cfg = {"interval": 2, "keep_last": 2, "steps": 4, "s3": s3}
    ckpt_harness.launch(
        {**cfg, "dir": str(tmp_path / "node-a")}, world=2, tmp=tmp_path, name="first"
    ).wait()
    node_b = tmp_path / "node-b"
    with s3_fault_proxy.FaultProxy(
        s3_server.endpoint_url, match="/step-000000004/", fail_first=None, modes=("503", "reset")
    ) as proxy:
        resumed = ckpt_harness.launch(
            {
                **cfg,
                "dir": str(node_b),
                "resume": True,
                "attempt": 1,
                "s3": {**s3, "endpoint_url": proxy.endpoint_url},
            },
            world=2,
            tmp=tmp_path,
            name="resumed",
        )
        codes = wait_all(resumed)
    assert all(code != 0 for code in codes), codes
    log = resumed.logs[0].read_text()
    assert "TransportError" in log
    assert "not falling back" in log
    # Step 2 was never tried, nothing was moved: the next attempt finds it all.
    assert layout.committed_steps(node_b) == []
    assert not (node_b / ".cairn" / "quarantine").exists()
    keys = ckpt_harness.bucket_keys(s3_server, bucket)
    assert remote.committed_steps(s3_server.client(), options.S3Options(**s3)) == [2, 4]
    assert not any("/.cairn/" in key for key in keys)


# -- a proven mismatch is quarantined, never deleted --------------------------------------


@pytest.mark.s3
def test_crc_corrupt_step_is_quarantined_not_deleted_and_resume_falls_back(
    tmp_path: pathlib.Path, s3_server: typing.Any
) -> None:
    bucket = s3_server.new_bucket("edges-corrupt")
    s3 = ckpt_harness.s3_cfg(s3_server, bucket)
    ckpt = tmp_path / "ckpt"
    cfg = {"interval": 2, "keep_last": 3, "steps": 6, "s3": s3, "dir": str(ckpt)}
    ckpt_harness.launch(cfg, world=2, tmp=tmp_path, name="first").wait()
    folder = layout.step_dir(ckpt, 6)
    found = layout.read_manifest(folder)
    shard = next(e.path for e in found.files if e.path.endswith(".distcp"))
    (folder / shard).write_bytes(flip_byte((folder / shard).read_bytes()))
    before = snapshot(folder)
    client = s3_server.client()
    prefix = remote.data_prefix(f"jobs/demo/{folder.name}", found)
    body = client.get_object(Bucket=bucket, Key=f"{prefix}/{shard}")["Body"].read()
    client.put_object(Bucket=bucket, Key=f"{prefix}/{shard}", Body=flip_byte(body))

    resumed = ckpt_harness.launch(
        {**cfg, "steps": 4, "resume": True, "attempt": 1}, world=2, tmp=tmp_path, name="resumed"
    )
    resumed.wait()
    for rank in range(2):
        assert resumed.result(rank)["restored"] == 4
        assert resumed.result(rank)["skipped"] == [6]
    # Locally: moved under .cairn/quarantine with its (corrupt) bytes and a reason.
    moved = copies_of(ckpt / ".cairn" / "quarantine", folder.name)
    assert len(moved) == 1
    assert snapshot(moved[0]) == before
    reason = moved[0].with_name(f"{folder.name}.reason.txt").read_text()
    assert "crc32c" in reason
    assert 6 not in layout.committed_steps(ckpt)
    # In S3: the manifest moved aside, the data objects untouched.
    keys = ckpt_harness.bucket_keys(s3_server, bucket)
    assert remote.committed_steps(client, options.S3Options(**s3)) == [2, 4]
    assert any(k.startswith("jobs/demo/.cairn/quarantine/") and folder.name in k for k in keys)
    assert f"{prefix}/{shard}" in keys
    events = resumed.result(0)["events"]
    assert {e["phase"] for e in events if e["step"] == 6} >= {"quarantined", "restore_fallback"}


# -- imports of foreign checkpoints ------------------------------------------------------------


class Small:
    """A model + AdamW + step counter in one process (no process group)."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.model(torch.randn(4, 8)).sum().backward()
        self.optim.step()
        self.train = state.TrainState()
        self.objects: dict[str, state.Stateful] = {
            "model": state.ModelOptimizerState(self.model, self.optim),
            "train": self.train,
        }

    def torchtitan_layout(self, step: int) -> dict[str, typing.Any]:
        flat = dcp_state_dict.StateDictOptions(flatten_optimizer_state_dict=True)
        return {
            "model": dcp_state_dict.get_model_state_dict(self.model),
            "optimizer": dcp_state_dict.get_optimizer_state_dict(
                self.model, self.optim, options=flat
            ),
            "train_state": {"step": torch.tensor(step, dtype=torch.int32)},
            "lr_scheduler": {"last_epoch": step},
        }


@pytest.mark.parametrize("layout_name", ["torchtitan", "model-state-dict", "bare", "user-map"])
def test_plain_dcp_step_folder_on_the_volume_is_imported_by_the_key_rule(
    tmp_path: pathlib.Path, layout_name: str
) -> None:
    source = Small(seed=1)
    weights = dcp_state_dict.get_model_state_dict(source.model)
    saved = {
        "torchtitan": source.torchtitan_layout(5),
        "model-state-dict": {"model": weights},
        "bare": dict(weights),
        "user-map": {"net": {"weights": weights}},
    }[layout_name]
    ckpt = tmp_path / "ckpt"
    folder = layout.step_dir(ckpt, 5)
    state_dict_saver.save(saved, checkpoint_id=folder, no_dist=True)
    before = snapshot(folder)
    user = foreign.KeyMap(model="net.weights.") if layout_name == "user-map" else None

    target = Small(seed=2)
    with manager.CheckpointManager(options.CheckpointOptions(directory=ckpt)) as m:
        result = m.restore(target.objects, step=5, key_map=user)
    assert result is not None
    assert result.imported
    assert result.step == 5
    for name, tensor in dcp_state_dict.get_model_state_dict(target.model).items():
        assert torch.equal(
            typing.cast(torch.Tensor, tensor), typing.cast(torch.Tensor, weights[name])
        )
    if layout_name == "torchtitan":
        assert target.train.step == 5
        for param_a, param_b in zip(
            source.model.parameters(), target.model.parameters(), strict=True
        ):
            a, b = source.optim.state[param_a], target.optim.state[param_b]
            assert torch.equal(a["exp_avg"], b["exp_avg"])
            assert torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    else:
        assert target.train.step == 0  # no step in the checkpoint: the counter starts fresh
        assert "train" in result.skipped_state
    assert snapshot(folder) == before  # read, never written


def test_an_explicit_step_of_a_newer_format_is_a_configuration_error_and_kept(
    tmp_path: pathlib.Path,
) -> None:
    source = Small(seed=1)
    with manager.CheckpointManager(options.CheckpointOptions(directory=tmp_path)) as m:
        m.save(5, source.objects, force=True)
    folder = layout.step_dir(tmp_path, 5)
    doc = json.loads((folder / manifest_mod.MANIFEST_NAME).read_text())
    doc["format_version"] = manifest_mod.FORMAT_VERSION + 1
    (folder / manifest_mod.MANIFEST_NAME).write_text(json.dumps(doc))
    before = snapshot(folder)
    with (
        manager.CheckpointManager(options.CheckpointOptions(directory=tmp_path, attempt=1)) as m,
        pytest.raises(errors.ConfigurationError, match="newer than the supported"),
    ):
        m.restore(Small(seed=2).objects, step=5)
    assert snapshot(folder) == before


def test_plain_dcp_folder_that_does_not_fit_the_model_is_a_configuration_error(
    tmp_path: pathlib.Path,
) -> None:
    folder = layout.step_dir(tmp_path, 3)
    state_dict_saver.save(
        {"model": {"other.weight": torch.ones(2)}}, checkpoint_id=folder, no_dist=True
    )
    target = Small(seed=2)
    before = [p.detach().clone() for p in target.model.parameters()]
    with (
        manager.CheckpointManager(options.CheckpointOptions(directory=tmp_path)) as m,
        pytest.raises(errors.ConfigurationError, match="cannot map the checkpoint's keys"),
    ):
        m.restore(target.objects, step=3)
    for old, new in zip(before, target.model.parameters(), strict=True):
        assert torch.equal(old, new)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _trainer_env(
    tmp: pathlib.Path, s3: typing.Any | None, bucket: str | None, **extra: str
) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        TMPDIR=str(tmp),
        TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"),
        OMP_NUM_THREADS="1",
        CAIRN_ATTEMPT="1",
        CAIRN_JOB_UID="0b5e7c1a-0000-4000-8000-000000000001",
        CAIRN_CHECKPOINT_INTERVAL_STEPS="2",
        CAIRN_TERMINATION_MESSAGE_PATH=str(tmp / "termination-log"),
    )
    if s3 is not None and bucket is not None:
        env.update(
            CAIRN_UPLOAD_URI=f"s3://{bucket}/run",
            AWS_ENDPOINT_URL_S3=s3.endpoint_url,
            AWS_ACCESS_KEY_ID=s3.access_key,
            AWS_SECRET_ACCESS_KEY=s3.secret_key,
            AWS_REGION=s3.region,
        )
    env.update(extra)
    return env


def _run_trainer(argv: list[str], env: dict[str, str], log: pathlib.Path) -> int:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(30)
            raise AssertionError(log.read_text()[-3000:]) from None


def _upload_folder(client: typing.Any, bucket: str, folder: pathlib.Path, prefix: str) -> None:
    for path in sorted(folder.iterdir()):
        client.put_object(Bucket=bucket, Key=f"{prefix}/{path.name}", Body=path.read_bytes())


@pytest.mark.s3
def test_torchtitan_layout_checkpoint_resumes_the_reference_trainer_via_resume_uri(
    tmp_path: pathlib.Path, s3_server: typing.Any
) -> None:
    step = 5
    # A TorchTitan-layout checkpoint of the reference model, written by plain
    # dcp.save: weights unlike a fresh init, AdamW state, train_state.step.
    torch.manual_seed(99)
    net = model.Decoder(model.ModelConfig())  # the reference trainer's default shape
    optim = torch.optim.AdamW(net.parameters(), lr=3e-3, foreach=False)
    batch = torch.randint(0, 256, (4, 33))
    model.loss_fn(net, batch).backward()  # type: ignore[no-untyped-call]
    optim.step()
    flat = dcp_state_dict.StateDictOptions(flatten_optimizer_state_dict=True)
    titan = tmp_path / "titan"
    state_dict_saver.save(
        {
            "model": dcp_state_dict.get_model_state_dict(net),
            "optimizer": dcp_state_dict.get_optimizer_state_dict(net, optim, options=flat),
            "train_state": {"step": torch.tensor(step, dtype=torch.int32)},
        },
        checkpoint_id=titan,
        no_dist=True,
    )
    bucket = s3_server.new_bucket("edges-titan")
    _upload_folder(s3_server.client(), bucket, titan, "imports/titan/step-5")

    # What the reference trainer's first step must log with these weights:
    # the mean of both ranks' losses on a fresh sampler's first batch.
    corpus = data.Corpus(vocab=256, seq_len=32, size=4096, seed=1234)
    expected = (
        sum(
            model.loss_fn(
                net,
                data.ShardedSampler(corpus=corpus, batch_per_rank=4, rank=r, world=2).next_batch(),
            ).item()
            for r in range(2)
        )
        / 2
    )

    run = tmp_path / "run"
    run.mkdir()
    env = _trainer_env(
        run, s3_server, bucket, CAIRN_RESUME_FROM=f"s3://{bucket}/imports/titan/step-5"
    )
    argv = [
        str(pathlib.Path(sys.executable).parent / "torchrun"),
        "--nproc-per-node=2",
        f"--master-port={_free_port()}",
        "-m",
        "cairn.trainer.reference",
        f"--steps={step + 2}",
        f"--checkpoint-dir={run / 'ckpt'}",
        f"--losses-file={run / 'losses.jsonl'}",
    ]
    code = _run_trainer(argv, env, run / "log.txt")
    log = (run / "log.txt").read_text()
    assert code == 0, log[-3000:]
    assert "imported from s3://" in log
    losses = [json.loads(line) for line in (run / "losses.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in losses] == [step + 1, step + 2]
    assert losses[0]["loss"] == pytest.approx(expected, rel=1e-5)
    # This job's own checkpoints carry on from the imported step.
    assert layout.committed_steps(run / "ckpt") == [step + 1, step + 2]


@dataclasses.dataclass(frozen=True)
class Garbage:
    objects: dict[str, bytes]
    """What lies at the resume URI (S3 objects under `given/`)."""
    resume: str
    """`uri` for that prefix, else the CAIRN_RESUME_FROM value itself."""
    reason: str
    """Text the termination message must contain."""


GARBAGE = {
    "not-a-checkpoint": Garbage(
        objects={"notes.txt": b"hello"},
        resume="uri",
        reason="neither a Cairn manifest.json nor a DCP .metadata",
    ),
    "garbage-metadata": Garbage(
        objects={".metadata": b"not a pickle", "__0_0.distcp": b"x"},
        resume="uri",
        reason="not readable DCP metadata",
    ),
    "newer-manifest-format": Garbage(
        objects={"manifest.json": json.dumps({"format_version": 99, "step": 3}).encode()},
        resume="uri",
        reason="newer than the supported",
    ),
    "missing-step": Garbage(objects={}, resume="step:99", reason="not committed anywhere"),
}


@pytest.mark.s3
@pytest.mark.parametrize("case", sorted(GARBAGE))
def test_garbage_resume_target_exits_78_with_the_reason_in_the_termination_file(
    tmp_path: pathlib.Path, s3_server: typing.Any, case: str
) -> None:
    objects, resume, reason = GARBAGE[case].objects, GARBAGE[case].resume, GARBAGE[case].reason
    bucket = s3_server.new_bucket(f"edges-garbage-{case}")
    client = s3_server.client()
    for name, body in objects.items():
        client.put_object(Bucket=bucket, Key=f"given/{name}", Body=body)
    target = f"s3://{bucket}/given" if resume == "uri" else resume
    env = _trainer_env(
        tmp_path,
        s3_server,
        bucket,
        CAIRN_RESUME_FROM=target,
        RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
    )
    argv = [
        sys.executable,
        "-m",
        "cairn.trainer.reference",
        "--steps=4",
        f"--checkpoint-dir={tmp_path / 'ckpt'}",
    ]
    code = _run_trainer(argv, env, tmp_path / "log.txt")
    assert code == exitcodes.CONFIG_ERROR, (tmp_path / "log.txt").read_text()[-3000:]
    message = (tmp_path / "termination-log").read_bytes()
    assert len(message) <= exitcodes.TERMINATION_MESSAGE_MAX_BYTES
    assert message.startswith(f"{exitcodes.CONFIG_ERROR_REASON}:".encode())
    assert reason in message.decode()
    assert layout.committed_steps(tmp_path / "ckpt") == []  # never a silent fresh start
