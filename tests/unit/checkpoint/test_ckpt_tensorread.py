"""Tensor entries read straight into their targets (`cairn.checkpoint.tensorread`),
against real `dcp.save` output loaded through `safedcp.load`.

Covers: float32, bfloat16, float64 and int64 tensors of the target's layout
are read directly (counted) and come back bit for bit beside a bytes entry;
a dtype change, a non-contiguous target and a tensor subclass go DCP's way
with DCP's own result; an empty tensor is not read at all (DCP plans no
read for it); a shape that does not fit is an error and the target keeps
its bytes; a `__reduce__` payload in a tensor entry is refused (naming the
entry) and never runs; `record_offset` declines a resharding narrow, a
record past the entry's end and an entry saved big-endian.
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
import pickle
import sys
import typing

import pytest
import torch
from torch.distributed.checkpoint import api as dcp_api
from torch.distributed.checkpoint import filesystem, planner, state_dict_loader, state_dict_saver

from cairn.checkpoint import load, safedcp, tensorread
from tests.unit.checkpoint.test_ckpt_safedcp import Payload

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Tagged(torch.Tensor):
    """A tensor subclass (as quantization or float8 libraries make): its bytes
    are not assumed to be its values."""


def save(folder: pathlib.Path, state_dict: dict[str, typing.Any]) -> None:
    state_dict_saver.save(
        state_dict, checkpoint_id=folder, planner=load.save_planner(), no_dist=True
    )


def safe_load(folder: pathlib.Path, state_dict: dict[str, typing.Any]) -> tensorread.Counts:
    meta = safedcp.read_metadata(folder)
    return safedcp.load(state_dict, folder=folder, meta=meta, allowed=None, process_group=None)


def dcp_load(folder: pathlib.Path, state_dict: dict[str, typing.Any]) -> None:
    """DCP's own reader, for the expected result (trusted test data only)."""
    state_dict_loader.load(
        state_dict, storage_reader=filesystem.FileSystemReader(folder), no_dist=True
    )


def saved_tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "w": torch.randn(64, 48),
        "half": torch.randn(33, 7).to(torch.bfloat16),
        "bias": torch.randn(48, dtype=torch.float64),
        "ids": torch.randint(0, 1 << 40, (5, 3)),
    }


def test_tensors_of_the_targets_layout_are_read_straight_in(tmp_path: pathlib.Path) -> None:
    tensors = saved_tensors()
    save(tmp_path, {**tensors, "extra": {"note": "kept", "n": 3}})
    targets: dict[str, typing.Any] = {k: torch.zeros_like(v) for k, v in tensors.items()}
    targets["extra"] = {"note": "", "n": 0}
    counts = safe_load(tmp_path, targets)
    assert counts == tensorread.Counts(direct=4, fallback=0)
    for key, want in tensors.items():
        assert torch.equal(targets[key], want), key
    assert targets["extra"] == {"note": "kept", "n": 3}


@pytest.mark.parametrize(
    "target",
    [
        pytest.param(lambda t: torch.zeros(64, 48, dtype=torch.float64), id="dtype-change"),
        pytest.param(lambda t: torch.zeros(48, 64).t(), id="non-contiguous-target"),
        pytest.param(lambda t: torch.zeros(64, 48).as_subclass(Tagged), id="subclass-target"),
    ],
)
def test_what_does_not_match_is_read_dcps_way_with_dcps_result(
    tmp_path: pathlib.Path, target: typing.Callable[[torch.Tensor], torch.Tensor]
) -> None:
    saved = saved_tensors()["w"]
    save(tmp_path, {"w": saved})
    ours, theirs = {"w": target(saved)}, {"w": target(saved)}
    counts = safe_load(tmp_path, ours)
    dcp_load(tmp_path, theirs)
    assert counts == tensorread.Counts(direct=0, fallback=1)
    assert torch.equal(ours["w"], theirs["w"])
    assert torch.equal(ours["w"].to(saved.dtype), saved)


def test_an_empty_tensor_beside_others(tmp_path: pathlib.Path) -> None:
    save(tmp_path, {"empty": torch.zeros(0, 4), "w": torch.ones(2, 2)})
    targets = {"empty": torch.zeros(0, 4), "w": torch.zeros(2, 2)}
    # DCP plans no read for an empty tensor; the other is read straight in.
    assert safe_load(tmp_path, targets) == tensorread.Counts(direct=1, fallback=0)
    assert torch.equal(targets["w"], torch.ones(2, 2))
    assert targets["empty"].shape == (0, 4)


def test_a_shape_that_does_not_fit_fails_and_leaves_the_target(tmp_path: pathlib.Path) -> None:
    save(tmp_path, {"w": torch.ones(4, 8)})
    targets = {"w": torch.full((8, 4), 7.0)}
    with pytest.raises(dcp_api.CheckpointException) as raised:
        safe_load(tmp_path, targets)
    assert "Size mismatch" in str(raised.value.failures)
    assert torch.equal(targets["w"], torch.full((8, 4), 7.0))


def payload_checkpoint(folder: pathlib.Path, marker: pathlib.Path) -> None:
    """A one-tensor checkpoint of "w" whose tensor entry is a `__reduce__`
    payload that would create `marker` if it ever ran."""
    save(folder, {"w": torch.ones(4, 8)})
    meta = safedcp.read_metadata(folder)
    ((index, info),) = meta.storage_data.items()
    blob = io.BytesIO()
    torch.save(Payload(marker), blob)
    (folder / info.relative_path).write_bytes(blob.getvalue())
    meta.storage_data[index] = dataclasses.replace(info, offset=0, length=len(blob.getvalue()))
    (folder / ".metadata").write_bytes(pickle.dumps(meta))


def test_a_reduce_payload_in_a_tensor_entry_is_refused_and_never_runs(
    tmp_path: pathlib.Path,
) -> None:
    marker = tmp_path / "ran"
    payload_checkpoint(tmp_path, marker)
    targets = {"w": torch.zeros(4, 8)}
    with pytest.raises(safedcp.UnsafeCheckpointError, match=r"'w' is not weights-only.*posix"):
        safe_load(tmp_path, targets)
    assert not marker.exists()
    assert torch.equal(targets["w"], torch.zeros(4, 8))


def one_entry(folder: pathlib.Path, saved: torch.Tensor) -> tuple[planner.ReadItem, typing.Any]:
    """The read item and storage info of a one-tensor checkpoint of `saved`."""
    save(folder, {"w": saved})
    meta = safedcp.read_metadata(folder)
    (info,) = meta.storage_data.values()
    from torch.distributed.checkpoint import default_planner

    (req,) = default_planner.create_default_local_load_plan({"w": saved}, meta).items
    return req, info


def offset_of(
    folder: pathlib.Path, info: typing.Any, target: torch.Tensor, req: typing.Any
) -> int | None:
    with (folder / info.relative_path).open("rb") as stream:
        return tensorread.record_offset(stream, info, target, req)


def test_record_offset_declines_a_resharding_narrow(tmp_path: pathlib.Path) -> None:
    saved = torch.arange(32.0).reshape(4, 8)
    req, info = one_entry(tmp_path, saved)
    assert offset_of(tmp_path, info, torch.zeros(4, 8), req) is not None
    narrowed = dataclasses.replace(
        req, storage_offsets=torch.Size([2, 0]), lengths=torch.Size([2, 8])
    )
    assert offset_of(tmp_path, info, torch.zeros(2, 8), narrowed) is None


def test_record_offset_declines_a_record_past_the_entrys_end(tmp_path: pathlib.Path) -> None:
    saved = torch.arange(32.0).reshape(4, 8)
    req, info = one_entry(tmp_path, saved)
    offset = offset_of(tmp_path, info, torch.zeros(4, 8), req)
    assert offset is not None
    short = dataclasses.replace(info, length=offset - info.offset + saved.nbytes - 1)
    assert offset_of(tmp_path, short, torch.zeros(4, 8), req) is None


def test_record_offset_declines_an_entry_saved_big_endian(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as patched:
        patched.setattr(sys, "byteorder", "big")  # torch.save records the saver's byte order
        req, info = one_entry(tmp_path, torch.arange(32.0).reshape(4, 8))
    assert offset_of(tmp_path, info, torch.zeros(4, 8), req) is None
