"""The pure parts of `bench/restore_tiers.py`: each arm's ratios are to the S3
time of the same arm, the direct/DCP ratio is per tier, and the dcp arm
turns the direct read off only while it runs."""

import importlib
import pathlib
import sys
from typing import Any

import pytest

sys.path.append(str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
restore_tiers: Any = importlib.import_module("restore_tiers")

from cairn.checkpoint import tensorread  # noqa: E402  (after the bench path)


def _row(scale: float, suffix: str = "") -> dict[str, float]:
    seconds = {
        "own_memory": 1.0,
        "peer_memory": 2.0,
        "local_volume": 1.5,
        "s3": 4.0,
        "peer_transport": 1.0,
        "s3_transport": 2.0,
    }
    return {f"{k}{suffix}": v * scale for k, v in seconds.items()}


def test_each_arm_divides_by_its_own_s3_and_direct_over_dcp_is_per_tier(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rows = [{**_row(1.0), **_row(2.0, "@dcp"), "page_cache-x": "0 cached"} for _ in range(3)]
    figures = restore_tiers.report(rows, nbytes=1 << 30, arms=["direct", "dcp"])
    tiers = figures["tiers"]
    assert tiers["peer_memory"]["ratio_to_s3"] == pytest.approx(0.5)
    assert tiers["peer_memory@dcp"]["ratio_to_s3"] == pytest.approx(0.5)
    assert tiers["peer_transport@dcp"]["ratio_to_s3"] == pytest.approx(0.5)
    assert figures["direct_over_dcp"] == pytest.approx(
        {"own_memory": 0.5, "peer_memory": 0.5, "local_volume": 0.5, "s3": 0.5}
    )
    assert figures["goal_peer_le_0.2x_s3"] is False
    assert "NOT met" in capsys.readouterr().out


def test_the_dcp_arm_turns_the_direct_read_off_only_inside() -> None:
    shipped = tensorread.record_offset
    with restore_tiers.arm("dcp"):
        off: Any = tensorread.record_offset  # the bench's stand-in takes anything
        assert off(None, None, None, None) is None
    assert tensorread.record_offset is shipped
    with restore_tiers.arm("direct"):
        assert tensorread.record_offset is shipped
