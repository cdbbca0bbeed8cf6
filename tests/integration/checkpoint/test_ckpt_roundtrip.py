"""Multi-process round trips of FSDP2 checkpoints (gloo on CPU).

Covers: 2-rank save → fresh 2-rank resume gives equal params, optimizer
state, RNG and data position, and the resumed run continues with the same
losses bit for bit; training keeps stepping while a save is written and the
saved values are those of the save step; 2-rank save → 1-rank load.
"""

from __future__ import annotations

import pathlib
import typing

import ckpt_harness  # type: ignore[import-not-found]
import pytest
import torch

pytestmark = pytest.mark.torch


def assert_tree_equal(a: typing.Any, b: typing.Any, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {set(a) ^ set(b)}"
        for key in a:
            assert_tree_equal(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_tree_equal(x, y, f"{path}[{i}]")
    elif hasattr(a, "shape"):  # numpy
        assert (a == b).all(), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def test_two_rank_round_trip_and_reshard(tmp_path: pathlib.Path) -> None:
    ckpt = tmp_path / "ckpt"
    base = {"dir": str(ckpt), "interval": 3, "keep_last": 3}
    straight = ckpt_harness.launch(
        {
            **base,
            "steps": 8,
            "dump_steps": [3, 6, 8],
            "measure_overlap_step": 3,
        },
        world=2,
        tmp=tmp_path,
        name="straight",
        # Hold the write of step 3 for 2 s so the overlap is unmistakable.
        env={
            "CAIRN_CKPT_FAULT": "write::3",
            "CAIRN_CKPT_FAULT_SLEEP": "2",
            "CAIRN_CKPT_FAULT_DIR": str(tmp_path),
        },
    )
    straight.wait()
    for rank in range(2):
        res = straight.result(rank)
        assert res["saved"] == [3, 6]
        # Training advanced while step 3 was being written in the background.
        assert res["steps_during_save"] >= 1, res
    resumed = ckpt_harness.launch(
        {**base, "steps": 8, "resume": True, "dump_steps": [8], "attempt": 1},
        world=2,
        tmp=tmp_path,
        name="resumed",
    )
    resumed.wait()
    for rank in range(2):
        res = resumed.result(rank)
        assert res["restored"] == 6
        assert res["skipped"] == []
        # Restored state equals the state at the save step, on every rank.
        assert_tree_equal(straight.dump(6, rank), resumed.dump("restored", rank))
        # ...and the run continues exactly as if it had never stopped.
        assert_tree_equal(straight.dump(8, rank), resumed.dump(8, rank))
        straight_losses = straight.result(rank)["losses"]
        for step, loss in res["losses"].items():
            assert loss == straight_losses[step], step

    # 2-rank checkpoint → 1 rank: DCP reshards params and optimizer state.
    single = ckpt_harness.launch(
        {**base, "steps": 6, "resume": True, "resume_step": 3, "attempt": 2},
        world=1,
        tmp=tmp_path,
        name="single",
    )
    single.wait()
    res = single.result(0)
    assert res["restored"] == 3
    assert res["skipped_state"] == ["rng"]
    one, two = single.dump("restored", 0), straight.dump(3, 0)
    assert_tree_equal(two["model"], one["model"])
    assert_tree_equal(two["optim"], one["optim"])
    assert one["data"] == two["data"] == 3
    assert one["train"] == two["train"]
