"""The pure parts of `bench/mttr.py`: each kind's ratio is to its own
runtime's pod-level median (torchrun rows to the faster of `pod` and
`pod-warm`, Ray rows to `ray-pod`),
a kind without kills prints an empty row, and the tier of a job's last
restore is read from its status."""

import importlib
import pathlib
import sys
from typing import Any

sys.path.append(str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
mttr: Any = importlib.import_module("mttr")


def _row(median: float) -> dict[str, Any]:
    row: dict[str, Any] = mttr.summary([median, median - 1, median + 1], [1.0])
    return row


def test_ratios_are_to_the_same_runtimes_pod_level() -> None:
    rows = {
        "pod": _row(10.0),
        "warm": _row(5.0),
        "ray-pod": _row(60.0),
        "ray": _row(6.0),
        "ray-mem": {"n": 0, "samples": []},
    }
    lines = mttr.table(rows).splitlines()
    assert lines[2].endswith("| 10.0 | 9.0 | 11.0 | 1.00 |")
    assert lines[3].endswith("| 5.0 | 4.0 | 6.0 | 0.50 |")
    assert lines[4].endswith("| 60.0 | 59.0 | 61.0 | 1.00 |")
    assert lines[5].endswith("| 6.0 | 5.0 | 7.0 | 0.10 |")
    assert lines[6] == f"| {mttr.LABELS['ray-mem']} | 0 | | | | |"


def test_torchrun_kills_divide_by_the_faster_pod_level_row() -> None:
    """Plain torchrun's and the warm launcher's pod-level restarts both anchor
    torchrun's process kills: the stronger (faster) one is the divisor."""
    rows = {"pod": _row(12.0), "pod-warm": _row(8.0), "warm": _row(2.0)}
    lines = mttr.table(rows).splitlines()
    assert lines[2].endswith("| 12.0 | 11.0 | 13.0 | 1.50 |")
    assert lines[3].endswith("| 8.0 | 7.0 | 9.0 | 1.00 |")
    assert lines[4].endswith("| 2.0 | 1.0 | 3.0 | 0.25 |")
    assert mttr.anchor_median({"pod": _row(12.0)}, "warm") == 12.0
    assert mttr.anchor_median({"warm": _row(2.0)}, "warm") is None


def test_no_pod_level_row_leaves_the_ratio_empty() -> None:
    (line,) = mttr.table({"ray": _row(6.0)}).splitlines()[2:]
    assert line.endswith("| 6.0 | 5.0 | 7.0 |  |")


def test_every_kind_has_a_label_and_an_anchor() -> None:
    kinds = {*mttr.TORCHRUN_KINDS, *mttr.RAY_KINDS}
    assert kinds == set(mttr.LABELS)
    lost = {kind for kind, shape in mttr.TORCHRUN_KINDS.items() if shape.get("lose")}
    assert lost == {"lost-gang", "lost-replace"}
    assert {mttr.anchors(kind) for kind in lost} == {("lost-gang",)}
    assert {mttr.anchors(kind) for kind in set(mttr.TORCHRUN_KINDS) - lost} == {("pod", "pod-warm")}
    ray_lost = {kind for kind, shape in mttr.RAY_KINDS.items() if shape["kill"] == "lost"}
    assert ray_lost == {"ray-lost-gang", "ray-lost", "ray-force-gang", "ray-force"}
    forced = {kind for kind in ray_lost if mttr.RAY_KINDS[kind].get("force")}
    assert forced == {"ray-force-gang", "ray-force"}
    assert {mttr.anchors(kind) for kind in ray_lost - forced} == {("ray-lost-gang",)}
    assert {mttr.anchors(kind) for kind in forced} == {("ray-force-gang",)}
    assert {mttr.anchors(kind) for kind in set(mttr.RAY_KINDS) - ray_lost} == {("ray-pod",)}
    anchors = {"pod", "pod-warm", "lost-gang", "ray-pod", "ray-lost-gang", "ray-force-gang"}
    assert anchors <= kinds  # anchors the bench runs
    assert mttr.RAY_KINDS["ray-lost-gang"]["in_place"] == 0
    assert mttr.RAY_KINDS["ray-force-gang"]["in_place"] == 0
    assert mttr.RAY_KINDS["ray-lost"].get("in_place", 10) > 0
    assert mttr.RAY_KINDS["ray-force"].get("in_place", 10) > 0
    assert mttr.TORCHRUN_KINDS["pod-warm"]["in_place"] == 0
    assert mttr.TORCHRUN_KINDS["pod-warm"]["command"] == mttr.TORCHRUN_KINDS["warm"]["command"]
    # The anchor of a pod loss restarts every pod; the replacement keeps the budget.
    assert mttr.TORCHRUN_KINDS["lost-gang"]["in_place"] == 0
    assert mttr.TORCHRUN_KINDS["lost-replace"]["in_place"] > 0


def test_last_tier() -> None:
    job = {"status": {"checkpoints": {"resumedFrom": {"step": 35, "tier": "memory"}}}}
    assert mttr.last_tier(job) == "memory"
    assert mttr.last_tier({"status": {}}) is None
    assert mttr.last_tier({}) is None
