"""The pure parts of `bench/save_every_step.py`: the timed steps of a block (the
upload step mid-block), the rotated arm order, which S3 keys count as an
uploaded step, the slower rank's step times and the per-arm figures."""

import importlib
import pathlib
import sys
from typing import Any

import pytest

# The benches are scripts that import each other as neighbours (`import record`):
# loaded by name with bench/ appended to the path (as tests/unit/test_scale_anchor.py).
sys.path.append(str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
bench: Any = importlib.import_module("save_every_step")


@pytest.mark.parametrize("m", [2, 3, 10, 11])
def test_block_holds_one_upload_step_with_steps_after_it(m: int) -> None:
    steps = bench.block_steps(m)
    assert len(steps) == m
    assert steps.start >= 2  # the warm-up save (steps.start - 1) is a real step
    uploads = [s for s in steps if s % m == 0]
    assert len(uploads) == 1
    assert uploads[0] < steps[-1]  # the steps after it carry its background work


def test_every_arm_goes_first_once_per_cycle() -> None:
    orders = [bench.arm_order(i) for i in range(len(bench.ARMS))]
    assert {order[0] for order in orders} == set(bench.ARMS)
    assert all(sorted(order) == sorted(bench.ARMS) for order in orders)
    assert bench.arm_order(len(bench.ARMS)) == bench.arm_order(0)


def test_uploaded_steps_counts_manifests_only() -> None:
    keys = [
        "bench/every_m/r0/step-000000010/manifest.json",
        "bench/every_m/r0/step-000000010/data/__0_0.distcp",  # data without its manifest
        "bench/every_m/r0/step-000000005/__0_0.distcp",
        "bench/every_m/r0/step-000000015/manifest.json.tmp",
        "bench/every_m/r0/xstep-7/manifest.json",
        "bench/every_m/r0/step-abc/manifest.json",
        "step-3/manifest.json",
    ]
    assert bench.uploaded_steps(keys) == [3, 10]
    assert bench.uploaded_steps([]) == []


def test_slower_rank_per_step() -> None:
    assert bench.slower_rank([[1.0, 4.0], [2.0, 3.0]]) == [2.0, 4.0]
    with pytest.raises(ValueError):
        bench.slower_rank([[1.0, 2.0], [1.0]])  # a rank that timed fewer steps is a bug


def test_summary_against_the_none_median() -> None:
    f = bench.summarize([1.0] * 9 + [11.0], none_median=1.0)
    assert f["steps"] == 10
    assert f["median_step_s"] == 1.0
    assert f["dip_ratio"] == 1.0
    assert f["mean_extra_s_per_step"] == pytest.approx(1.0)  # one 10 s spike over 10 steps
    assert f["p90_step_s"] == pytest.approx(2.0)


def test_size_tag_of_small_and_large_models() -> None:
    assert bench.size_tag(16_777_216) == "17M"
    assert bench.size_tag(131_072) == "0.13M"
