"""The TrainingJob models accept the examples and reject the malformed table.

Covers: every manifest in examples/ parses; every case in malformed_cases is
rejected with an error located at (or above) the named field; defaults; the
Python twin of the immutability transition rules.
"""

import pathlib
from typing import Any

import pydantic
import pytest
import yaml

from cairn.api import checkpointspec, trainingjob

from . import malformed_cases

ROOT = pathlib.Path(__file__).resolve().parents[3]
EXAMPLES = sorted(
    p
    for p in (ROOT / "examples").glob("*.yaml")
    if yaml.safe_load(p.read_text()).get("kind") == trainingjob.KIND
)


def _locations(error: pydantic.ValidationError) -> list[str]:
    out = []
    for item in error.errors():
        parts: list[str] = []
        for part in item["loc"]:
            if isinstance(part, int):
                parts[-1] = f"{parts[-1]}[{part}]"
            else:
                parts.append(str(part))
        out.append(".".join(parts))
    return out


def test_there_are_enough_malformed_cases() -> None:
    assert len(malformed_cases.CASES) >= 30
    ids = [c.id for c in malformed_cases.CASES]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("case", malformed_cases.CASES, ids=lambda c: c.id)
def test_malformed_is_rejected_at_the_field(case: malformed_cases.Case) -> None:
    body = malformed_cases.build(case)
    with pytest.raises(pydantic.ValidationError) as caught:
        trainingjob.TrainingJob.model_validate(body)
    locations = _locations(caught.value)
    # pydantic reports model-level checks at the enclosing object and adds the
    # union branch / type tag to some paths; the error must sit on the path.
    assert any(
        case.field == loc
        or case.field.startswith(loc + ".")
        or case.field.startswith(loc + "[")
        or loc.startswith(case.field)
        for loc in locations
    ), (case.field, locations)


def test_base_of_the_table_is_valid() -> None:
    trainingjob.TrainingJob.model_validate(malformed_cases.BASE)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_parse(path: pathlib.Path) -> None:
    trainingjob.TrainingJob.model_validate(yaml.safe_load(path.read_text()))


def test_there_are_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {"quickstart.yaml"}
    assert len(EXAMPLES) >= 3


def test_defaults() -> None:
    job = trainingjob.TrainingJob.model_validate(
        {"metadata": {"name": "d"}, "spec": {"image": "i"}}
    )
    spec = job.spec
    assert (spec.suspend, spec.nodes, spec.procs_per_node) == (False, 1, 1)
    assert spec.checkpoint.mount_path == "/checkpoints"
    assert spec.checkpoint.volume.empty_dir is not None
    assert spec.checkpoint.async_mode == "pinned"
    assert spec.checkpoint.retention.local.keep_last == 3
    assert spec.checkpoint.resume.latest is True
    assert spec.checkpoint.on_delete == "Retain"
    assert spec.restart_policy.max_restarts == 3
    assert spec.cleanup.finished_pods == "Keep"
    assert spec.managed_by_cairn


def _spec(**changes: Any) -> trainingjob.TrainingJobSpec:
    body: dict[str, Any] = {"image": "i:1", "nodes": 2, **changes}
    return trainingjob.TrainingJobSpec.model_validate(body)


UPDATE_CASES = [
    pytest.param(_spec(), _spec(image="i:2"), ["spec.image"], id="image-while-running"),
    pytest.param(_spec(), _spec(nodes=4), ["spec.nodes"], id="nodes-while-running"),
    pytest.param(_spec(suspend=True), _spec(suspend=True, nodes=4), [], id="nodes-while-suspended"),
    pytest.param(_spec(), _spec(suspend=True, image="i:2"), [], id="suspend-and-edit-together"),
    pytest.param(
        _spec(), _spec(restartPolicy={"maxRestarts": 9}), [], id="restart-policy-is-mutable"
    ),
    pytest.param(_spec(), _spec(activeDeadlineSeconds=60), [], id="deadline-is-mutable"),
    pytest.param(
        _spec(suspend=True),
        _spec(suspend=True, managedBy="example.com/x"),
        ["spec.managedBy"],
        id="managed-by-immutable",
    ),
    pytest.param(
        _spec(),
        _spec(checkpoint={"intervalSteps": 3}),
        ["spec.checkpoint"],
        id="checkpoint-while-running",
    ),
]


@pytest.mark.parametrize(("old", "new", "fields"), UPDATE_CASES)
def test_update_rules(
    old: trainingjob.TrainingJobSpec, new: trainingjob.TrainingJobSpec, fields: list[str]
) -> None:
    errors = trainingjob.update_errors(old=old, new=new)
    assert [e.split(" ")[0] for e in errors] == fields


def test_status_accepts_what_the_writer_reports() -> None:
    status = trainingjob.TrainingJobStatus.model_validate(
        {
            "phase": "Running",
            "step": 12,
            "futureField": 1,
            "checkpoints": {
                "lastCommitted": {"step": 10, "time": "2026-11-22T23:00:00Z", "bytes": 5},
                "lastUploaded": {"step": 5, "uri": "s3://b/p/step-000000005", "verified": True},
                "inFlight": [{"step": 15, "stage": "writing"}],
                "history": [{"step": 10, "state": "committed"}, {"step": 5, "state": "verified"}],
                "resumedFrom": {"step": 0, "attempt": 1, "source": "remote"},
            },
        }
    )
    assert status.checkpoints is not None
    assert status.checkpoints.last_committed is not None
    assert status.checkpoints.last_committed.step == 10


@pytest.mark.parametrize(
    ("uri", "split"),
    [
        ("s3://bucket/a/b", ("bucket", "a/b")),
        ("s3://bucket/a/b/", ("bucket", "a/b")),
        ("s3://bucket", ("bucket", "")),
        ("s3://bucket/", ("bucket", "")),
    ],
)
def test_split_s3_uri(uri: str, split: tuple[str, str]) -> None:
    assert checkpointspec.split_s3_uri(uri) == split
