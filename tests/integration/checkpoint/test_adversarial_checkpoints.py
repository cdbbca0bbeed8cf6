"""Adversarial checkpoints: a checkpoint is data, never code (issue #19, part A).

Real files, real gloo ranks (`ckpt_worker`), the real S3 server. Every
payload is a pickle `__reduce__` that would create a marker file in the
rank that unpickles it; every case asserts the marker does not exist, that
the planted step is still there byte for byte (kept, never deleted or
quarantined: its bytes match its manifest), and how the restore refused it.

Covers, each a named case:
- "latest" on a shared volume, planted newer steps with a matching
  manifest (sizes + CRC32C) whose `.metadata` is a payload, whose bytes
  entry (`train.step`) is a torch.save payload, or whose metadata refers to
  `../<another step>/<file>`, an absolute path, or a file not in the
  manifest: skipped and reported (`restore_fallback`, `skipped`), the job
  resumes from its newest good step;
- the same metadata payload on node-local volumes (each rank's own step);
- the same metadata payload in the job's S3 prefix (fresh volumes);
- explicit targets fail with ConfigurationError naming the refused class,
  key or path: resume.step of a Cairn step with a bytes-entry payload;
  resume.uri of plain DCP folders in S3 with a `.metadata` payload, a
  bytes-entry payload, an escaping file reference;
- resume.sha256: a pin that differs fails before the payload is even
  unpickled; the right pin imports the checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import os
import pathlib
import pickle
import shutil
import typing

import ckpt_harness  # type: ignore[import-not-found]
import pytest
import torch
from torch.distributed.checkpoint import filesystem, state_dict_saver
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import state_dict as dcp_state_dict

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import errors, layout, manager, options, safedcp, state

pytestmark = [
    pytest.mark.torch,
    pytest.mark.filterwarnings(
        "ignore:torch.distributed is disabled:UserWarning",
        "ignore:torch.distributed is unavailable:UserWarning",
    ),
]


class Payload:
    """Unpickling this runs `touch <marker>`: what a hostile checkpoint would do."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[typing.Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def snapshot(folder: pathlib.Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def remanifest(folder: pathlib.Path, *, step: int) -> None:
    """Rewrite folder's manifest for `step` with the sizes and CRC32C of its
    files as they are now, listing planted `*.distcp` files too: the planted
    step verifies (what an attacker with write access to the volume can do)."""
    old = manifest_mod.parse_manifest((folder / manifest_mod.MANIFEST_NAME).read_bytes())
    names = {entry.path: entry for entry in old.files}
    for path in folder.glob("*.distcp"):
        names.setdefault(path.name, old.files[0].model_copy(update={"path": path.name}))
    entries = []
    for name, entry in sorted(names.items()):
        if not (folder / name).is_file():  # node-local: another rank's file
            entries.append(entry)
            continue
        size, crc = layout.file_crc32c(folder / name)
        entries.append(entry.model_copy(update={"size": size, "crc32c": crc}))
    new = old.model_copy(update={"step": step, "files": tuple(entries), "signature": None})
    (folder / manifest_mod.MANIFEST_NAME).write_bytes(manifest_mod.dump_manifest(new))


def rewrite_metadata(folder: pathlib.Path, change: typing.Callable[[typing.Any], None]) -> None:
    meta = safedcp.read_metadata(folder)
    change(meta)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))


def storage_of(meta: dcp_metadata.Metadata, fqn: str) -> filesystem._StorageInfo:
    for index, info in meta.storage_data.items():
        if index.fqn == fqn:
            return typing.cast(filesystem._StorageInfo, info)
    raise KeyError(fqn)


def torch_saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# -- what an attacker plants ---------------------------------------------------------------


def plant_metadata_payload(folder: pathlib.Path, marker: pathlib.Path) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))


def plant_bytes_payload(folder: pathlib.Path, marker: pathlib.Path) -> None:
    """Valid metadata whose `train.step` bytes entry is a torch.save payload."""
    blob = torch_saved(Payload(marker))
    (folder / "__9_0.distcp").write_bytes(blob)

    def point(meta: typing.Any) -> None:
        info = storage_of(meta, "train.step")
        info.relative_path, info.offset, info.length = "__9_0.distcp", 0, len(blob)

    rewrite_metadata(folder, point)


def plant_reference(path: str) -> typing.Callable[[pathlib.Path, pathlib.Path], None]:
    """Valid metadata whose first tensor entry is read from `path`."""

    def plant(folder: pathlib.Path, marker: pathlib.Path) -> None:
        def point(meta: typing.Any) -> None:
            info = next(iter(meta.storage_data.values()))
            info.relative_path = path

        rewrite_metadata(folder, point)

    return plant


PLANTS: dict[str, tuple[typing.Callable[[pathlib.Path, pathlib.Path], None], str]] = {
    "metadata-payload": (plant_metadata_payload, "posix.system"),
    "bytes-entry-payload": (plant_bytes_payload, "'train.step' is not weights-only data"),
    "escaping-path": (plant_reference("../step-000000004/__0_0.distcp"), "outside the folder"),
    "absolute-path": (plant_reference("/etc/hostname"), "outside the folder"),
    "name-not-in-manifest": (plant_reference("__7_0.distcp"), "not one of the checkpoint's"),
}


# -- "latest": skipped and reported, the job resumes from its newest good step --------------


def assert_kept(root: pathlib.Path, step: int, before: dict[str, bytes]) -> None:
    """Kept byte for byte: in place, or moved aside as a superseded branch of
    the new lineage; never quarantined, never deleted."""
    name = manifest_mod.step_dir_name(step)
    survivors = sorted(p for p in root.rglob(name) if p.is_dir())
    assert len(survivors) == 1, survivors
    assert "quarantine" not in survivors[0].parts
    assert snapshot(survivors[0]) == before


def test_latest_skips_every_planted_step_on_a_shared_volume(tmp_path: pathlib.Path) -> None:
    """One planted step per case, newest first (one resume tries them all):
    each is skipped and reported with its reason, the job resumes from step 4."""
    ckpt, marker = tmp_path / "ckpt", tmp_path / "payload-ran"
    # keep_last covers every step: retention is not what this case is about.
    cfg = {"interval": 2, "keep_last": 10, "steps": 4, "dir": str(ckpt)}
    ckpt_harness.launch(cfg, world=2, tmp=tmp_path, name="first").wait()
    planted = {6 + 2 * i: name for i, name in enumerate(sorted(PLANTS))}
    before: dict[int, dict[str, bytes]] = {}
    for step, name in planted.items():
        folder = layout.step_dir(ckpt, step)
        shutil.copytree(layout.step_dir(ckpt, 4), folder)
        PLANTS[name][0](folder, marker)
        remanifest(folder, step=step)
        before[step] = snapshot(folder)
    # Each verifies as a committed step of this job (sizes and CRC32C match).
    assert layout.committed_steps(ckpt) == [2, 4, *planted]
    job = ckpt_harness.launch(
        {**cfg, "resume": True, "attempt": 1}, world=2, tmp=tmp_path, name="resumed"
    )
    job.wait()
    assert not marker.exists(), "a payload ran"
    for rank in range(2):
        result = job.result(rank)
        assert result["restored"] == 4
        assert result["skipped"] == sorted(planted, reverse=True)
        assert result["quarantined"] == []
        fallbacks = {
            e["step"]: e["message"] for e in result["events"] if e["phase"] == "restore_fallback"
        }
        for step, name in planted.items():
            assert PLANTS[name][1] in fallbacks[step], (name, fallbacks[step])
    for step in planted:
        assert_kept(ckpt, step, before[step])


def test_latest_skips_a_metadata_payload_on_node_local_volumes(tmp_path: pathlib.Path) -> None:
    volumes = str(tmp_path / "volume-{rank}")
    cfg = {"interval": 2, "keep_last": 3, "steps": 4, "dir": volumes}
    ckpt_harness.launch(cfg, world=2, tmp=tmp_path, name="first").wait()
    marker = tmp_path / "payload-ran"
    before: dict[int, dict[str, bytes]] = {}
    for rank in range(2):
        volume = pathlib.Path(volumes.format(rank=rank))
        planted = layout.step_dir(volume, 6)
        shutil.copytree(layout.step_dir(volume, 4), planted)
        plant_metadata_payload(planted, marker)
        remanifest(planted, step=6)
        before[rank] = snapshot(planted)
    job = ckpt_harness.launch(
        {**cfg, "resume": True, "attempt": 1}, world=2, tmp=tmp_path, name="resumed"
    )
    job.wait()
    assert not marker.exists(), "the payload ran"
    for rank in range(2):
        result = job.result(rank)
        assert (result["restored"], result["skipped"]) == (4, [6])
        assert_kept(pathlib.Path(volumes.format(rank=rank)), 6, before[rank])


@pytest.mark.s3
def test_latest_skips_a_metadata_payload_in_the_s3_prefix(
    tmp_path: pathlib.Path, s3_server: typing.Any
) -> None:
    bucket = s3_server.new_bucket("adversarial-prefix")
    s3 = ckpt_harness.s3_cfg(s3_server, bucket)
    cfg = {"interval": 2, "steps": 4, "s3": s3, "dir": str(tmp_path / "first-volume")}
    ckpt_harness.launch(cfg, world=2, tmp=tmp_path, name="first").wait()
    client = s3_server.client()
    marker = tmp_path / "payload-ran"
    # Step 6 in the job's own prefix: step 4's objects, a payload `.metadata`
    # and a manifest that matches them.
    staging = tmp_path / "staging"
    staging.mkdir()
    source, target = "jobs/demo/step-000000004", "jobs/demo/step-000000006"
    for key in ckpt_harness.bucket_keys(s3_server, bucket):
        if key.startswith(f"{source}/"):
            name = key[len(source) + 1 :]
            local = staging / name
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data_root = staging
    manifest = manifest_mod.parse_manifest((staging / manifest_mod.MANIFEST_NAME).read_bytes())
    if manifest.data_prefix:
        data_root = staging / manifest.data_prefix
    plant_metadata_payload(data_root, marker)
    size, crc = layout.file_crc32c(data_root / ".metadata")
    files = tuple(
        e.model_copy(update={"size": size, "crc32c": crc}) if e.path == ".metadata" else e
        for e in manifest.files
    )
    planted = manifest.model_copy(update={"step": 6, "files": files, "signature": None})
    (staging / manifest_mod.MANIFEST_NAME).write_bytes(manifest_mod.dump_manifest(planted))
    for local in sorted(p for p in staging.rglob("*") if p.is_file()):
        key = f"{target}/{local.relative_to(staging).as_posix()}"
        client.put_object(Bucket=bucket, Key=key, Body=local.read_bytes())
    before = [k for k in ckpt_harness.bucket_keys(s3_server, bucket) if k.startswith(target)]

    job = ckpt_harness.launch(
        {**cfg, "dir": str(tmp_path / "fresh-volume"), "resume": True, "attempt": 1},
        world=2,
        tmp=tmp_path,
        name="resumed",
    )
    job.wait()
    assert not marker.exists(), "the payload ran"
    for rank in range(2):
        result = job.result(rank)
        assert (result["restored"], result["skipped"]) == (4, [6])
        assert result["quarantined"] == []
    keys = ckpt_harness.bucket_keys(s3_server, bucket)
    # Kept: every data object in place; the manifest in place or moved aside
    # as a superseded branch of the new lineage (never quarantined or deleted).
    assert {k for k in before if not k.endswith(manifest_mod.MANIFEST_NAME)} <= set(keys)
    manifests = [k for k in keys if k.endswith(f"step-000000006/{manifest_mod.MANIFEST_NAME}")]
    assert len(manifests) == 1, manifests
    assert "quarantine" not in manifests[0]
    kept = client.get_object(Bucket=bucket, Key=manifests[0])["Body"].read()
    assert kept == manifest_mod.dump_manifest(planted)


# -- explicit targets: a ConfigurationError naming what was refused ------------------------


class Small:
    """A model + AdamW + step counter in one process (no process group)."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2))
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.train = state.TrainState()
        self.objects: dict[str, state.Stateful] = {
            "model": state.ModelOptimizerState(self.model, self.optim),
            "train": self.train,
        }

    def weights(self) -> dict[str, torch.Tensor]:
        return {
            k: typing.cast(torch.Tensor, v).detach().clone()
            for k, v in dcp_state_dict.get_model_state_dict(self.model).items()
        }


def test_explicit_step_with_a_bytes_entry_payload_is_a_configuration_error(
    tmp_path: pathlib.Path,
) -> None:
    marker = tmp_path / "payload-ran"
    ckpt = tmp_path / "ckpt"
    with manager.CheckpointManager(options.CheckpointOptions(directory=ckpt)) as m:
        m.save(5, Small(seed=1).objects, force=True)
    folder = layout.step_dir(ckpt, 5)
    plant_bytes_payload(folder, marker)
    remanifest(folder, step=5)
    before = snapshot(folder)
    target = Small(seed=2)
    untouched = target.weights()
    with (
        manager.CheckpointManager(options.CheckpointOptions(directory=ckpt, attempt=1)) as m,
        pytest.raises(errors.ConfigurationError, match=r"'train\.step'.*posix\.system"),
    ):
        m.restore(target.objects, step=5)
    assert not marker.exists()
    assert snapshot(folder) == before
    assert all(torch.equal(untouched[k], v) for k, v in target.weights().items())


def upload_folder(client: typing.Any, bucket: str, prefix: str, folder: pathlib.Path) -> None:
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        client.put_object(Bucket=bucket, Key=f"{prefix}/{path.name}", Body=path.read_bytes())


def import_from(
    tmp_path: pathlib.Path, s3_server: typing.Any, *, uri: str, sha256: str | None = None
) -> Small:
    bucket = uri.removeprefix("s3://").partition("/")[0]
    opts = options.CheckpointOptions(
        directory=tmp_path / "volume",
        s3=options.S3Options(**ckpt_harness.s3_cfg(s3_server, bucket)),
    )
    target = Small(seed=2)
    with manager.CheckpointManager(opts) as m:
        m.restore(target.objects, uri=uri, sha256=sha256)
    return target


def plain_dcp(folder: pathlib.Path, extra: dict[str, typing.Any] | None = None) -> Small:
    source = Small(seed=1)
    state_dict_saver.save(
        {"model": dcp_state_dict.get_model_state_dict(source.model), **(extra or {})},
        checkpoint_id=folder,
        no_dist=True,
    )
    return source


@pytest.mark.s3
@pytest.mark.parametrize(
    "case",
    ["metadata-payload", "bytes-entry-payload", "escaping-path", "absolute-path"],
)
def test_resume_uri_of_a_hostile_plain_dcp_folder_is_a_configuration_error(
    tmp_path: pathlib.Path, s3_server: typing.Any, case: str
) -> None:
    marker = tmp_path / "payload-ran"
    folder = tmp_path / "source"
    if case == "bytes-entry-payload":
        plain_dcp(folder, extra={"notes": {"evil": Payload(marker)}})
        reason = r"'notes\.evil' is not weights-only data.*posix\.system"
    else:
        plain_dcp(folder)
    if case == "metadata-payload":
        plant_metadata_payload(folder, marker)
        reason = r"posix\.system"
    elif case in ("escaping-path", "absolute-path"):
        path = "../escaped.distcp" if case == "escaping-path" else str(tmp_path / "abs.distcp")
        plant_reference(path)(folder, marker)
        reason = "outside the folder"
    bucket = s3_server.new_bucket(f"adversarial-uri-{case}")
    upload_folder(s3_server.client(), bucket, "imports/run", folder)
    before = ckpt_harness.bucket_keys(s3_server, bucket)
    with pytest.raises(errors.ConfigurationError, match=reason):
        import_from(tmp_path, s3_server, uri=f"s3://{bucket}/imports/run")
    assert not marker.exists(), "the payload ran"
    assert ckpt_harness.bucket_keys(s3_server, bucket) == before
    assert not list(tmp_path.rglob("escaped.distcp")) and not (tmp_path / "abs.distcp").exists()


@pytest.mark.s3
def test_resume_sha256_pins_the_reviewed_metadata(
    tmp_path: pathlib.Path, s3_server: typing.Any
) -> None:
    folder = tmp_path / "source"
    source = plain_dcp(folder)
    reviewed = hashlib.sha256((folder / ".metadata").read_bytes()).hexdigest()
    bucket = s3_server.new_bucket("adversarial-pin")
    upload_folder(s3_server.client(), bucket, "imports/run", folder)
    uri = f"s3://{bucket}/imports/run"
    imported = import_from(tmp_path / "a", s3_server, uri=uri, sha256=reviewed)
    assert all(torch.equal(source.weights()[k], v) for k, v in imported.weights().items())
    # Swapped after the review: a payload with another hash fails before unpickling.
    marker = tmp_path / "payload-ran"
    plant_metadata_payload(folder, marker)
    upload_folder(s3_server.client(), bucket, "imports/run", folder)
    with pytest.raises(errors.ConfigurationError, match=r"resume\.sha256 pins"):
        import_from(tmp_path / "b", s3_server, uri=uri, sha256=reviewed)
    assert not marker.exists(), "the payload ran"
