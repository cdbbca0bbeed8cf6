"""The Argo CD health check (charts/cairn/files/health.lua) run by a real Lua.

Covers: the verdict and message for every phase on the status the operator's
own ``status.patch`` writes; a spec edit the operator has not observed yet
(Progressing, whatever the phase); an object with no status; an unknown
phase; a stale checkpoint surfacing in a Running job's message; and that the
script only uses Lua 5.1 (Argo CD runs gopher-lua, a 5.1 dialect: lupa's
``lua51`` runtime).
"""

import pathlib
from typing import Any

import pytest
from lupa import lua51

from cairn.api import jobstatus

from . import samples

HEALTH_LUA = (
    pathlib.Path(__file__).resolve().parents[3] / "charts" / "cairn" / "files" / "health.lua"
)

EXPECTED: dict[jobstatus.Phase, str] = {
    "Pending": "Progressing",
    "Starting": "Progressing",
    "Running": "Progressing",
    "Restarting": "Progressing",
    "Suspending": "Progressing",
    "Suspended": "Suspended",
    "Succeeded": "Healthy",
    "Failed": "Degraded",
}


def _to_lua(runtime: lua51.LuaRuntime, value: Any) -> Any:
    """Python JSON -> Lua tables the way Argo CD converts objects (1-based arrays)."""
    if isinstance(value, dict):
        return runtime.table_from({k: _to_lua(runtime, v) for k, v in value.items()})
    if isinstance(value, list):
        return runtime.table_from([_to_lua(runtime, v) for v in value])
    return value


def health(obj: dict[str, Any]) -> dict[str, str]:
    """Run health.lua with ``obj`` as Argo CD's global ``obj``; return hs."""
    runtime = lua51.LuaRuntime(unpack_returned_tuples=True)
    runtime.globals()["obj"] = _to_lua(runtime, obj)
    result: Any = runtime.execute(HEALTH_LUA.read_text())
    return {"status": str(result["status"]), "message": str(result["message"])}


def test_every_phase_is_covered() -> None:
    assert set(EXPECTED) == set(jobstatus.PHASES)


@pytest.mark.parametrize("phase", jobstatus.PHASES)
def test_phase_verdict_and_message(phase: jobstatus.Phase) -> None:
    hs = health(samples.job_object(phase))
    assert hs["status"] == EXPECTED[phase]
    assert hs["message"] == samples.SAMPLES[phase].message


@pytest.mark.parametrize("phase", jobstatus.PHASES)
def test_unobserved_spec_edit_is_progressing(phase: jobstatus.Phase) -> None:
    hs = health(samples.job_object(phase, generation=3, observed_generation=2))
    assert hs == {
        "status": "Progressing",
        "message": "Waiting for the operator to observe generation 3",
    }


def test_no_status_yet_is_progressing() -> None:
    hs = health(samples.fresh_object())
    assert hs["status"] == "Progressing"
    assert "operator" in hs["message"]


def test_unknown_phase_is_unknown() -> None:
    obj = samples.job_object("Running")
    obj["status"]["phase"] = "Exploded"
    assert health(obj) == {"status": "Unknown", "message": "Unknown phase Exploded"}


def test_stale_checkpoint_is_named_in_a_running_job() -> None:
    obj = samples.job_object("Running")
    for c in obj["status"]["conditions"]:
        if c["type"] == "CheckpointStale":
            c.update(status="True", message="no checkpoint committed for 4000s")
    hs = health(obj)
    assert hs["status"] == "Progressing"
    assert hs["message"].endswith("(no checkpoint committed for 4000s)")


def test_script_uses_only_lua51() -> None:
    # goto/labels and integer division are 5.2+/5.3+; gopher-lua would reject them.
    text = HEALTH_LUA.read_text()
    for newer in ("goto ", "::", "//", "<const>", "<close>"):
        assert newer not in text
