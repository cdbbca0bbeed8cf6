"""docs/images/checkpoint_timeline.py: the picture is the committed run's, and pairs uploads right.

Covers: the committed SVG is what ``render`` draws from the committed JSON
(picture and data cannot drift apart); a step committed by attempt 1, lost
with its pod and committed anew by attempt 2 gets attempt 2's upload only
(attempt 1's commit shows no upload), a commit's upload is its first after
it; the attempts' Running windows and the step each attempt resumed from.
"""

import importlib.util
import json
import pathlib
from types import ModuleType

IMAGES = pathlib.Path(__file__).resolve().parents[2] / "docs" / "images"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("timeline", IMAGES / "checkpoint_timeline.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def snap(at: float, phase: str, attempt: int, **checkpoints: object) -> dict[str, object]:
    return {
        "at": 1_800_000_000 + at,
        "status": {"phase": phase, "attempt": attempt, "checkpoints": checkpoints},
    }


def stamp(seconds: int) -> str:
    return f"2027-01-15T08:00:{seconds:02d}Z"  # 1_800_000_000 is 2027-01-15T08:00:00Z


def test_committed_picture_is_rendered_from_committed_data() -> None:
    timeline = load()
    data = json.loads((IMAGES / "checkpoint-timeline.json").read_text())
    assert (IMAGES / "checkpoint-timeline.svg").read_text() == timeline.svg(timeline.timeline(data))


def test_a_recommitted_step_gets_only_its_own_upload() -> None:
    timeline = load()
    c5 = {"step": 5, "time": stamp(2), "writeSeconds": 0.5, "stallSeconds": 0.1}
    c15 = {"step": 15, "time": stamp(6), "writeSeconds": 0.5}
    c15_again = {"step": 15, "time": stamp(40), "writeSeconds": 0.4}
    data = {
        "created": stamp(0),
        "snapshots": [
            snap(1, "Running", 1),
            snap(3, "Running", 1, lastCommitted=c5, lastUploaded={"step": 5, "time": stamp(3)}),
            snap(7, "Running", 1, lastCommitted=c15),
            snap(30, "Running", 2, lastCommitted=c15, resumedFrom={"step": 5, "attempt": 2}),
            snap(41, "Running", 2, lastCommitted=c15_again),
            snap(42, "Running", 2, lastUploaded={"step": 15, "time": stamp(42)}),
        ],
    }
    line = timeline.timeline(data)
    assert [(c["step"], c["at"], c["uploaded"]) for c in line["commits"]] == [
        (5, 2.0, 3.0),
        (15, 6.0, None),
        (15, 40.0, 42.0),
    ]
    assert line["attempts"] == {1: [1.0, 7.0], 2: [30.0, 42.0]}
    assert line["resumes"] == {2: 5}
    assert "restart: 23 s" in timeline.svg(line)
