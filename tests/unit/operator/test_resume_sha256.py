"""`checkpoint.resume.sha256` from the spec to the trainer's restore call.

Covers: the spec accepts 64 lowercase hex digits with a step or uri target
and refuses it otherwise (pydantic and the same rule as CEL in the CRD);
the operator's resume target carries it for the first attempt only (later
attempts resume "latest", unpinned); the pod env has `CAIRN_RESUME_SHA256`
exactly when pinned; the trainer's runtime config parses it back and refuses
a malformed or target-less pin naming the variable.
"""

import typing

import pydantic
import pytest

from cairn.api import checkpointspec, podenv
from cairn.checkpoint import runtime_config
from cairn.operator.core import decisions, envvars

from . import jobs

PIN = "ab" * 32
URI = "s3://bucket/imports/run-7"
UPLOAD = {"uri": "s3://bucket/jobs/demo"}


@pytest.mark.parametrize(
    "resume", [{"uri": URI, "sha256": PIN}, {"step": 3, "sha256": PIN}, {"uri": URI}]
)
def test_the_spec_accepts_a_pin_of_an_explicit_target(resume: dict[str, typing.Any]) -> None:
    assert checkpointspec.Resume.model_validate(resume).sha256 == resume.get("sha256")


@pytest.mark.parametrize(
    ("resume", "message"),
    [
        ({"latest": True, "sha256": PIN}, "explicit target"),
        ({"uri": URI, "sha256": PIN.upper()}, "pattern"),
        ({"uri": URI, "sha256": PIN[:-1]}, "pattern"),
    ],
    ids=["latest", "uppercase", "short"],
)
def test_the_spec_refuses_a_bad_pin(resume: dict[str, typing.Any], message: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=message):
        checkpointspec.Resume.model_validate(resume)


def test_the_pin_reaches_the_first_attempts_pods_only() -> None:
    job = jobs.job(checkpoint={"resume": {"uri": URI, "sha256": PIN}, "upload": UPLOAD})
    target = decisions.resume_target(job)
    assert target == podenv.ResumeTarget(kind="uri", uri=URI, sha256=PIN)
    env = {
        e["name"]: e.get("value") for e in envvars.pod_env(job, attempt=1, rank=0, resume=target)
    }
    assert env[podenv.RESUME_SHA256] == PIN
    assert env[podenv.RESUME_FROM] == URI
    committed = jobs.job(
        status={"checkpoints": {"lastCommitted": {"step": 4, "attempt": 1}}},
        checkpoint={"resume": {"uri": URI, "sha256": PIN}, "upload": UPLOAD},
    )
    later = decisions.resume_target(committed)
    assert later == podenv.ResumeTarget(kind="latest")
    names = {e["name"] for e in envvars.pod_env(committed, attempt=2, rank=0, resume=later)}
    assert podenv.RESUME_SHA256 not in names


def test_the_trainer_reads_the_pin_back() -> None:
    env = {podenv.RESUME_FROM: "step:3", podenv.RESUME_SHA256: PIN}
    assert runtime_config.from_env(env).resume == podenv.ResumeTarget(
        kind="step", step=3, sha256=PIN
    )


@pytest.mark.parametrize(
    "env",
    [
        {podenv.RESUME_FROM: "latest", podenv.RESUME_SHA256: PIN},
        {podenv.RESUME_FROM: URI, podenv.RESUME_SHA256: "not-hex"},
    ],
    ids=["latest", "not-hex"],
)
def test_the_trainer_refuses_a_bad_pin_naming_the_variable(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match=podenv.RESUME_SHA256):
        podenv.parse_resume(env[podenv.RESUME_FROM], sha256=env[podenv.RESUME_SHA256])
