"""The pod env contract: resume targets round-trip; names are unique.

Covers: format_resume/parse_resume both ways, rejection of garbage naming the
variable, no two constants with the same value.
"""

import pytest

from cairn.api import podenv


@pytest.mark.parametrize(
    ("target", "text"),
    [
        (podenv.ResumeTarget(kind="latest"), "latest"),
        (podenv.ResumeTarget(kind="none"), "none"),
        (podenv.ResumeTarget(kind="step", step=120), "step:120"),
        (podenv.ResumeTarget(kind="uri", uri="s3://b/p/step-000000120"), "s3://b/p/step-000000120"),
    ],
)
def test_resume_round_trip(target: podenv.ResumeTarget, text: str) -> None:
    assert podenv.format_resume(target) == text
    assert podenv.parse_resume(text) == target


@pytest.mark.parametrize("text", ["", "step:", "step:x", "gs://b", "Latest"])
def test_resume_garbage(text: str) -> None:
    with pytest.raises(ValueError, match=podenv.RESUME_FROM):
        podenv.parse_resume(text)


def test_resume_target_invariants() -> None:
    with pytest.raises(ValueError, match="step"):
        podenv.ResumeTarget(kind="step")
    with pytest.raises(ValueError, match="uri"):
        podenv.ResumeTarget(kind="latest", uri="s3://b/p")


def test_names_are_unique() -> None:
    values = [
        v
        for k, v in vars(podenv).items()
        if k.isupper() and isinstance(v, str) and k != "RESUME_KIND"
    ]
    assert len(values) == len(set(values))
