"""Status integrity without a cluster: the policy document, the token mount, ``verified``.

Covers: ``crds/cairn.dev_status-policy.yaml`` matches what ``statuspolicy``
generates (the chart's copy is checked with the other generated chart files
in tests/unit/gitops/test_chart_generated.py); the
policy matches the job's own trainer ServiceAccount (the name
``names`` gives it) or a token bound to a pod named like the job's pods, on
trainingjobs and their /status, checks the writer pod (``names.pod_name``
of rank 0) first, refuses every verification claim the CRD schema allows in
the writer fields, denies, and fails closed; only rank 0's pod mounts a ServiceAccount token; a writer-asserted
``lastUploaded.verified`` does not make ``CheckpointUploaded`` report
Verified, the operator's own ``status.storage.verifiedStep`` does. The CEL
itself is exercised by the API server in
tests/integration/operator/test_status_policy.py.
"""

import pathlib
from typing import Any

import pytest

from cairn.api import podenv, trainingjob
from cairn.operator.core import builders, conditions, jobobserve, jobplan, names, statuspolicy

from . import jobs

REPO = pathlib.Path(__file__).resolve().parents[3]


def test_committed_policy_matches_the_generator() -> None:
    committed = (REPO / statuspolicy.DEFAULT_OUTPUT).read_text()
    assert committed == statuspolicy.render()
    assert statuspolicy.main(["--check", "--output", str(REPO / statuspolicy.DEFAULT_OUTPUT)]) == 0


def test_policy_names_the_trainer_account_and_denies() -> None:
    policy, binding = statuspolicy.documents()
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    rule = spec["matchConstraints"]["resourceRules"][0]
    assert rule["resources"] == ["trainingjobs", "trainingjobs/status"]
    assert rule["operations"] == ["UPDATE"]
    suffix = names.service_account_name("x").removeprefix("x")
    assert f"'{suffix}'" in spec["matchConditions"][0]["expression"]
    assert binding["spec"] == {
        "policyName": policy["metadata"]["name"],
        "validationActions": ["Deny"],
    }
    writer = next(v for v in spec["variables"] if v["name"] == "writerFields")
    assert writer["expression"] == "['step', 'checkpoints', 'ray', 'torchrun']"


@pytest.mark.parametrize(("job", "attempt", "rank"), [("j", 1, 0), ("team-run-7", 12, 3)])
def test_pod_name_parts_follow_names(job: str, attempt: int, rank: int) -> None:
    """The CEL builds ``names.pod_name`` from these parts (the writer pod, the job-pod regex)."""
    built = f"{job}{statuspolicy.ATTEMPT_INFIX}{attempt}{statuspolicy.RANK_INFIX}{rank}"
    assert names.pod_name(job=job, attempt=attempt, rank=rank) == built
    assert f"'{statuspolicy.RANK_INFIX}{statuspolicy.WRITER_RANK}'" in statuspolicy.WRITER_POD


def test_policy_matches_the_job_account_or_a_job_pod_token() -> None:
    [condition] = statuspolicy.policy()["spec"]["matchConditions"]
    assert condition["expression"] == statuspolicy.MATCH
    assert statuspolicy.POD_NAME_CLAIM in statuspolicy.JOB_POD_TOKEN
    first = statuspolicy.policy()["spec"]["validations"][0]
    assert first["expression"] == "variables.tokenPod == variables.writerPod"


def test_verified_claims_cover_every_writer_field_claim() -> None:
    """Found by walking the CRD schema: each a validation of its own."""
    claims = statuspolicy.verified_claims()
    assert [path for _, path in claims] == [
        "status.checkpoints.lastUploaded.verified",
        "status.checkpoints.history[].state",
    ]
    rules = {v["expression"] for v in statuspolicy.policy()["spec"]["validations"]}
    assert {rule for rule, _ in claims} <= rules


def test_verified_claims_walk_nested_arrays_and_non_boolean_fields() -> None:
    schema = {
        "properties": {
            "a": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "verifiedBy": {"type": "string"},
                        "b": {
                            "type": "array",
                            "items": {"properties": {"verified": {"type": "boolean"}}},
                        },
                    },
                },
            },
            "c": {"type": "string", "enum": ["verified", "other"]},
            "d": {"type": "string"},
        }
    }
    claims = statuspolicy._verified_claims(schema, value="v", path="status", depth=0)
    assert claims == [
        ("v.?a.orValue([]).all(x0, !x0.?verifiedBy.hasValue())", "status.a[].verifiedBy"),
        (
            "v.?a.orValue([]).all(x0, x0.?b.orValue([]).all(x1, !x1.?verified.orValue(false)))",
            "status.a[].b[].verified",
        ),
        ("v.?c.orValue('') != 'verified'", "status.c"),
    ]


def test_only_rank_zero_mounts_a_token() -> None:
    job = jobs.job(nodes=3)
    pods = builders.attempt_pods(job, attempt=1, resume=podenv.ResumeTarget(kind="latest"))
    assert [p["spec"]["automountServiceAccountToken"] for p in pods] == [True, False, False]


def _uploaded_condition(status: dict[str, Any]) -> trainingjob.Condition:
    base = jobs.job(checkpoint={"upload": {"uri": "s3://bkt/p"}})
    raw = base.model_dump(mode="json", by_alias=True, exclude_none=True)
    raw["status"] = {"phase": "Running", "attempt": 1, **status}
    job = trainingjob.TrainingJob.model_validate(raw)
    result = jobplan.plan(
        job=job, observed=jobobserve.Observed(pods=(jobs.pod(1, 0), jobs.pod(1, 1))), now=jobs.at(5)
    )
    found = next(
        (
            c
            for c in (result.status or {}).get("conditions") or ()
            if c["type"] == "CheckpointUploaded"
        ),
        None,
    )
    assert found is not None
    return trainingjob.Condition.model_validate(found)


UPLOADED = {"step": 5, "uri": "s3://bkt/p/step-000000005"}


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        ({"checkpoints": {"lastUploaded": {**UPLOADED, "verified": True}}}, "Uploaded"),
        (
            {"checkpoints": {"lastUploaded": UPLOADED}, "storage": {"verifiedStep": 5}},
            "Verified",
        ),
        (
            {"checkpoints": {"lastUploaded": UPLOADED}, "storage": {"verifiedStep": 4}},
            "Uploaded",
        ),
    ],
    ids=["writer-asserted", "operator-verified", "verified-older-step"],
)
def test_verified_only_from_the_operator(status: dict[str, Any], reason: str) -> None:
    condition = _uploaded_condition(status)
    assert condition.reason == reason
    assert reason in (conditions.REASON_VERIFIED, conditions.REASON_UPLOADED)
