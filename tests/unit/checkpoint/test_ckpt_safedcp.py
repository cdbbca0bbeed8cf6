"""Reading DCP checkpoints as data (`cairn.checkpoint.safedcp`), against real `dcp.save` output.

Covers: the allow-list admits the metadata of a real save (a model with
AdamW, a StepLR, Cairn's RNG/train state; a plain module) and round-trips
that state through the safe reader and planner; it refuses, naming the
class, a `__reduce__` payload (the payload never runs), and any other
global; garbage and non-Metadata objects; file references that escape the
folder (`../x`, absolute) or are not in the allowed set; negative offsets;
stream transforms; a pinned SHA-256 that differs is a ConfigurationError
before unpickling; a bytes entry that is a pickle payload is refused by
`check_bytes` and by the load planner, naming the key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import pathlib
import pickle
import typing

import pytest
import torch
from torch.distributed.checkpoint import filesystem, state_dict_saver
from torch.distributed.checkpoint import metadata as dcp_metadata

from cairn.checkpoint import errors, load, safedcp, state

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Payload:
    """Unpickling this creates `marker` (what a malicious checkpoint would run)."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[typing.Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def cairn_objects(seed: int) -> dict[str, typing.Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    sched.step()
    return {
        "model_optim": state.ModelOptimizerState(model, optim),
        "lr_scheduler": sched,
        "rng": state.RNGState(),
        "train": state.TrainState(step=3 + seed, tokens_seen=7),
    }


def save(folder: pathlib.Path, objects: typing.Mapping[str, typing.Any]) -> None:
    state_dict_saver.save(
        {name: obj.state_dict() for name, obj in objects.items()},
        checkpoint_id=folder,
        planner=load.save_planner(),
        no_dist=True,
    )


def rewrite_metadata(folder: pathlib.Path, change: typing.Callable[[typing.Any], None]) -> None:
    """Change the real metadata of folder in place (as an attacker with write access could)."""
    meta = safedcp.read_metadata(folder)
    change(meta)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))


def first_storage(meta: dcp_metadata.Metadata) -> filesystem._StorageInfo:
    info: filesystem._StorageInfo = next(iter(meta.storage_data.values()))
    return info


def test_real_metadata_is_admitted_and_state_round_trips(tmp_path: pathlib.Path) -> None:
    saved = cairn_objects(seed=1)
    save(tmp_path, saved)
    meta = safedcp.read_metadata(
        tmp_path, allowed=safedcp.referenced_files(safedcp.read_metadata(tmp_path))
    )
    assert safedcp.check_bytes(tmp_path, meta, files=safedcp.referenced_files(meta)) > 0
    target = cairn_objects(seed=2)
    dicts = {name: obj.state_dict() for name, obj in target.items()}
    safedcp.load(dicts, folder=tmp_path, meta=meta, allowed=None, process_group=None)
    for name, obj in target.items():
        obj.load_state_dict(dicts[name])
    assert target["train"].state_dict() == saved["train"].state_dict()
    assert target["lr_scheduler"].state_dict() == saved["lr_scheduler"].state_dict()
    for a, b in zip(
        saved["model_optim"].model.parameters(),
        target["model_optim"].model.parameters(),
        strict=True,
    ):
        assert torch.equal(a, b)


def test_plain_module_metadata_is_admitted(tmp_path: pathlib.Path) -> None:
    state_dict_saver.save(
        {"model": torch.nn.Linear(2, 2).state_dict()}, checkpoint_id=tmp_path, no_dist=True
    )
    assert set(state.checkpoint_keys(tmp_path)) == {"model.weight", "model.bias"}


def test_a_reduce_payload_in_metadata_is_refused_and_never_runs(tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(safedcp.UnsafeCheckpointError, match=r"posix\.system"):
        safedcp.read_metadata(tmp_path)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        (pickle.dumps(print), "builtins.print"),
        (pickle.dumps(dataclasses.dataclass), "dataclasses.dataclass"),
        (pickle.dumps(torch.load), "torch.serialization.load"),
        (pickle.dumps({"a": io.BytesIO}), "_io.BytesIO"),
    ],
    ids=["builtin", "stdlib", "torch-function", "nested-class"],
)
def test_any_global_outside_the_allow_list_is_refused(
    tmp_path: pathlib.Path, payload: bytes, named: str
) -> None:
    (tmp_path / ".metadata").write_bytes(payload)
    with pytest.raises(safedcp.UnsafeCheckpointError, match=named.replace(".", r"\.")):
        safedcp.read_metadata(tmp_path)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"not a pickle", "not readable DCP metadata"),
        (pickle.dumps({"state_dict_metadata": {}}), "holds dict, not DCP Metadata"),
        (pickle.dumps(dcp_metadata.Metadata(state_dict_metadata={"k": 3})), "'k' is a int"),  # type: ignore[dict-item]
    ],
    ids=["garbage", "not-metadata", "bad-entry"],
)
def test_what_is_not_dcp_metadata_is_refused(
    tmp_path: pathlib.Path, raw: bytes, message: str
) -> None:
    (tmp_path / ".metadata").write_bytes(raw)
    with pytest.raises(safedcp.UnsafeCheckpointError, match=message):
        safedcp.read_metadata(tmp_path)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("relative_path", "../x", "outside the folder"),
        ("relative_path", "/etc/passwd", "outside the folder"),
        ("relative_path", "sub/../../x", "outside the folder"),
        ("relative_path", "not-listed.distcp", "not one of the checkpoint's listed files"),
        ("offset", -1, "has offset -1"),
        ("length", -5, "length -5"),
        ("transform_descriptors", ["zstd/1"], "stream transforms"),
    ],
)
def test_unsafe_file_references_are_refused(
    tmp_path: pathlib.Path, field: str, value: object, message: str
) -> None:
    save(tmp_path, {"train": state.TrainState(step=1)})
    listed = set(os.listdir(tmp_path))
    rewrite_metadata(tmp_path, lambda meta: setattr(first_storage(meta), field, value))
    with pytest.raises(safedcp.UnsafeCheckpointError, match=message):
        safedcp.read_metadata(tmp_path, allowed=listed)


def test_a_pinned_sha256_that_differs_fails_before_unpickling(tmp_path: pathlib.Path) -> None:
    marker = tmp_path / "ran"
    raw = pickle.dumps(Payload(marker))
    (tmp_path / ".metadata").write_bytes(raw)
    with pytest.raises(errors.ConfigurationError, match=r"resume\.sha256 pins"):
        safedcp.read_metadata(tmp_path, sha256="0" * 64)
    assert not marker.exists()
    # The right pin does not make a payload safe: it is still refused, never run.
    with pytest.raises(safedcp.UnsafeCheckpointError, match=r"posix\.system"):
        safedcp.read_metadata(tmp_path, sha256=hashlib.sha256(raw).hexdigest())
    assert not marker.exists()


def test_a_matching_pin_reads_real_metadata(tmp_path: pathlib.Path) -> None:
    save(tmp_path, {"train": state.TrainState(step=1)})
    pin = hashlib.sha256((tmp_path / ".metadata").read_bytes()).hexdigest()
    assert "train.step" in safedcp.read_metadata(tmp_path, sha256=pin).state_dict_metadata


def test_a_symlinked_metadata_is_refused(tmp_path: pathlib.Path) -> None:
    real = tmp_path / "real"
    save(real, {"train": state.TrainState(step=1)})
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / ".metadata").symlink_to(real / ".metadata")
    with pytest.raises(safedcp.UnsafeCheckpointError, match="symlink"):
        safedcp.read_metadata(linked)


def test_a_bytes_entry_payload_is_refused_by_check_and_by_the_planner(
    tmp_path: pathlib.Path,
) -> None:
    marker = tmp_path / "ran"
    folder = tmp_path / "ckpt"
    state_dict_saver.save(
        {"train": {"step": 1, "evil": Payload(marker)}}, checkpoint_id=folder, no_dist=True
    )
    meta = safedcp.read_metadata(folder)
    with pytest.raises(safedcp.UnsafeCheckpointError, match=r"'train\.evil'.*posix\.system"):
        safedcp.check_bytes(folder, meta, files=safedcp.referenced_files(meta))
    template: dict[str, typing.Any] = {"train": {"step": 0, "evil": None}}
    with pytest.raises(safedcp.UnsafeCheckpointError, match=r"'train\.evil'"):
        safedcp.load(template, folder=folder, meta=meta, allowed=None, process_group=None)
    assert not marker.exists()
