"""``spec.ttlSecondsAfterFinished`` as a pure decision.

Covers: no TTL, not finished, no completionTime, or already being deleted:
never due; Succeeded and Failed: due completionTime + TTL; a TTL of 0 is due
at once; a non-integer (or boolean) value is ignored; the Event message.
"""

import datetime

import pytest

from cairn.operator.core import ttl

DONE = "2026-11-23T10:00:00Z"
AT = datetime.datetime(2026, 11, 23, 10, 0, tzinfo=datetime.UTC)


def body(
    ttl_value: object = 30, phase: str | None = "Succeeded", **meta: object
) -> dict[str, object]:
    status: dict[str, object] = {"phase": phase} if phase else {}
    if phase in ("Succeeded", "Failed"):
        status["completionTime"] = DONE
    spec = {} if ttl_value is None else {"ttlSecondsAfterFinished": ttl_value}
    return {"metadata": {"name": "j", **meta}, "spec": spec, "status": status}


@pytest.mark.parametrize(
    "raw",
    [
        body(ttl_value=None),
        body(phase="Running"),
        body(phase=None),
        body(ttl_value="30"),
        body(ttl_value=True),
        body(deletionTimestamp=DONE),
        {"metadata": {}, "spec": {"ttlSecondsAfterFinished": 5}, "status": {"phase": "Failed"}},
    ],
    ids=["no-ttl", "running", "no-status", "string", "bool", "deleting", "no-completion-time"],
)
def test_never_due(raw: dict[str, object]) -> None:
    assert ttl.due_at(raw) is None
    assert ttl.seconds_left(raw, now=AT) is None


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_due_after_completion(phase: str) -> None:
    raw = body(phase=phase)
    assert ttl.due_at(raw) == AT + datetime.timedelta(seconds=30)
    assert ttl.seconds_left(raw, now=AT + datetime.timedelta(seconds=10)) == 20
    assert ttl.seconds_left(raw, now=AT + datetime.timedelta(seconds=40)) == -10
    assert ttl.message(raw) == f"deleted 30 s after it {phase} (spec.ttlSecondsAfterFinished)"


def test_zero_is_due_at_completion() -> None:
    assert ttl.seconds_left(body(ttl_value=0), now=AT) == 0
