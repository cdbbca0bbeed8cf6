"""``spec.runtime`` / ``spec.ray`` / ``status.ray`` in the pydantic models.

Covers: torchrun is the default; ``spec.ray`` only with ``runtime: ray``;
``runtime: ray`` needs a command (the launcher is prepended to it); Ray's
smallest object store; the reserved ``cairn-ray`` volume name; runtime and
ray settings change only while suspended (the Python twin of the CEL rules);
``status.ray`` parses the driver's fields. The same rules in the API server:
tests/integration/operator/test_ray_api.py.
"""

from typing import Any

import pydantic
import pytest

from cairn.api import trainingjob


def _spec(**fields: Any) -> trainingjob.TrainingJobSpec:
    return trainingjob.TrainingJobSpec.model_validate(
        {"image": "img", "command": ["python", "-m", "x"], **fields}
    )


def test_torchrun_is_the_default() -> None:
    spec = _spec()
    assert spec.runtime == "torchrun" and spec.ray is None
    assert spec.ray_settings.max_in_place_restarts == 3


def test_ray_settings() -> None:
    spec = _spec(runtime="ray", ray={"version": "2.60.0", "numCpus": 2, "numGpus": 1})
    assert spec.ray is not None and (spec.ray.num_cpus, spec.ray.num_gpus) == (2, 1)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"ray": {"numCpus": 1}}, "spec.ray is allowed only with runtime: ray"),
        ({"runtime": "ray", "command": None}, "runtime: ray needs spec.command"),
        ({"runtime": "ray", "ray": {"objectStoreMemoryBytes": 1024}}, "greater than or equal"),
        ({"runtime": "ray", "ray": {"version": "latest"}}, "should match pattern"),
        ({"runtime": "mpi"}, "torchrun"),
        (
            {"template": {"volumes": [{"name": "cairn-ray", "emptyDir": {}}]}},
            "cairn-ray is reserved",
        ),
    ],
)
def test_refused(fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=needle):
        _spec(**fields)


def test_runtime_and_ray_change_only_while_suspended() -> None:
    old = _spec()
    new = _spec(runtime="ray")
    assert trainingjob.update_errors(old=old, new=new) == [
        "spec.runtime can only change while the job is suspended"
    ]
    ray = _spec(runtime="ray", ray={"numCpus": 1})
    more = _spec(runtime="ray", ray={"numCpus": 2})
    assert trainingjob.update_errors(old=ray, new=more) == [
        "spec.ray can only change while the job is suspended"
    ]
    suspended = _spec(suspend=True)
    assert trainingjob.update_errors(old=suspended, new=_spec(suspend=True, runtime="ray")) == []


def test_status_ray_parses_the_drivers_fields() -> None:
    status = trainingjob.TrainingJobStatus.model_validate(
        {
            "ray": {
                "group": 2,
                "inPlaceRestarts": 2,
                "lastInPlaceRestart": {
                    "time": "2026-11-23T10:00:00Z",
                    "reason": "x",
                    "fromStep": 5,
                },
            }
        }
    )
    assert status.ray is not None and status.ray.group == 2
    assert status.ray.last_in_place_restart is not None
    assert status.ray.last_in_place_restart.from_step == 5
