"""End to end: `kubectl cairn resume JOB --from-step N` on a suspended job resumes from N.

The real operator, real pods (the node agent runs them as local
processes), the reference trainer and the real S3 server: a job trains to
several committed and uploaded steps and is suspended (final checkpoint);
`resume --from-step 7` (never committed) is refused with the reason on
stderr and leaves the job as it was; `resume --from-step 5` (an older
committed step) makes the next attempt load exactly step 5
(`status.checkpoints.resumedFrom.step == 5`, recorded in
`status.resumeApplied`, said in the attempt's Event); a rank then killed
after the new lineage's first commit makes the attempt after that resume
from the newest step, not from 5 again (the explicit target applies once).
Prints `E2E-NUMBERS` for the closing report.
"""

import contextlib
import datetime
import io
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from cairn.kubectl_plugin import cli
from tests import demo

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.timeout(420)]

NAME = "fromstep"
WAIT_SECONDS = 150.0


@pytest.fixture
def space(devcluster: Any, operator: Any) -> Iterator[tuple[str, str]]:
    """A fresh namespace and S3 bucket (with the credentials Secret); the namespace is deleted."""
    namespace = f"e2e-{uuid.uuid4().hex[:8]}"
    bucket = f"e2e-{uuid.uuid4().hex[:10]}"
    demo.prepare_namespace(
        api_client=devcluster.api_client,
        target=devcluster.target,
        namespace=namespace,
        bucket=bucket,
    )
    yield namespace, bucket
    with contextlib.suppress(ApiException):
        client.CoreV1Api(devcluster.api_client).delete_namespace(namespace)


def _body(devcluster: Any, bucket: str) -> dict[str, Any]:
    body = demo.quickstart_manifest(devcluster.target, name=NAME)
    spec = body["spec"]
    args = list(spec["args"])
    args[args.index("--steps") + 1] = "60"
    args[args.index("--step-delay") + 1] = "0.3"
    spec["args"] = args
    ckpt = spec["checkpoint"]
    ckpt["upload"]["uri"] = f"s3://{bucket}/{NAME}"
    del ckpt["retention"]["remote"]  # keep every step in S3: step 5 must stay loadable
    spec["restartPolicy"] = {"maxRestarts": 3, "backoffSeconds": 1}
    return body


def _wait(
    custom: client.CustomObjectsApi,
    namespace: str,
    what: str,
    done: Callable[[dict[str, Any]], bool],
) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        job = demo.get_job(custom, namespace, NAME)
        if done(job):
            return job
        assert time.monotonic() < deadline, f"no {what} within {WAIT_SECONDS:.0f}s: {job['status']}"
        time.sleep(0.5)


def _status(job: dict[str, Any]) -> dict[str, Any]:
    return job.get("status") or {}


def _ckpt(job: dict[str, Any], key: str) -> dict[str, Any]:
    return (_status(job).get("checkpoints") or {}).get(key) or {}


def _plugin(devcluster: Any, namespace: str, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.main(["--kubeconfig", str(devcluster.kubeconfig), "-n", namespace, *args], out=out)
    return code, out.getvalue()


def _time(value: str | None) -> datetime.datetime:
    if value is None:
        return datetime.datetime.min.replace(tzinfo=datetime.UTC)
    return datetime.datetime.fromisoformat(value)


def _event(core: client.CoreV1Api, namespace: str, *parts: str) -> bool:
    """An Event on the job whose message has every part (listed when none does)."""
    events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={NAME}")
    messages = [e.message or "" for e in events.items]
    found = any(all(p in m for p in parts) for m in messages)
    if not found:
        print("events:", messages)
    return found


def _resumed_by(attempt: int) -> Callable[[dict[str, Any]], bool]:
    return lambda job: (_ckpt(job, "resumedFrom").get("attempt") or 0) >= attempt


def test_resume_from_an_older_step_applies_once(
    devcluster: Any, space: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    namespace, bucket = space
    custom = client.CustomObjectsApi(devcluster.api_client)
    core = client.CoreV1Api(devcluster.api_client)
    started = time.monotonic()
    custom.create_namespaced_custom_object(
        "cairn.dev", "v1alpha1", namespace, "trainingjobs", _body(devcluster, bucket)
    )
    _wait(
        custom,
        namespace,
        "upload of step 10",
        lambda j: _ckpt(j, "lastUploaded").get("step", 0) >= 10,
    )
    custom.patch_namespaced_custom_object(
        "cairn.dev", "v1alpha1", namespace, "trainingjobs", NAME, {"spec": {"suspend": True}}
    )
    held = _wait(custom, namespace, "Suspended", lambda j: _status(j).get("phase") == "Suspended")
    suspended_attempt = _status(held)["attempt"]
    newest = _ckpt(held, "lastCommitted")["step"]
    assert newest >= 10

    # Refused: never committed; nothing changes.
    capsys.readouterr()
    assert _plugin(devcluster, namespace, "resume", NAME, "--from-step", "7") == (1, "")
    assert "step 7 is not a committed checkpoint of trainingjob fromstep" in capsys.readouterr().err
    unchanged = demo.get_job(custom, namespace, NAME)
    assert unchanged["metadata"]["resourceVersion"] == held["metadata"]["resourceVersion"]
    assert unchanged["spec"]["suspend"] is True

    # Accepted: an older committed step.
    code, out = _plugin(devcluster, namespace, "resume", NAME, "--from-step", "5")
    assert (code, out) == (
        0,
        f"trainingjob.cairn.dev/{NAME} patched: resume from step 5, resuming"
        " (field manager kubectl-cairn)\n",
    )
    attempt = suspended_attempt + 1
    job = _wait(custom, namespace, f"load by attempt {attempt}", _resumed_by(attempt))
    resumed = _ckpt(job, "resumedFrom")
    assert resumed["step"] == 5, resumed
    assert resumed["attempt"] == attempt
    applied = _status(job)["resumeApplied"]
    assert (applied["target"], applied["attempt"]) == ("step:5", attempt)
    assert _event(core, namespace, f"attempt {attempt}:", "resuming from step:5", "applied once")
    resumed_seconds = time.monotonic() - started

    # A crash after the new lineage's first commit resumes from its newest step, not 5.
    job = _wait(
        custom,
        namespace,
        "a commit after step 5",
        lambda j: (
            _status(j).get("attempt") == attempt
            and _status(j).get("phase") == "Running"
            and _ckpt(j, "lastCommitted").get("step", 0) > 5
            # Committed by this attempt, not the suspend's final checkpoint.
            and _time(_ckpt(j, "lastCommitted").get("time"))
            > _time(_status(j).get("attemptStartTime"))
        ),
    )
    killed_after = _ckpt(job, "lastCommitted")["step"]
    assert demo.kill_rank(core, namespace=namespace, job=NAME, rank=1) is not None
    later = _wait(custom, namespace, f"load by attempt {attempt + 1}", _resumed_by(attempt + 1))
    again = _ckpt(later, "resumedFrom")
    assert again["step"] >= killed_after > 5, again
    assert _status(later)["resumeApplied"]["attempt"] == attempt  # not applied again
    assert _event(core, namespace, f"attempt {attempt + 1}:", "resuming from latest")
    print(
        "E2E-NUMBERS resume_from_step "
        f"suspended_at={newest} resumed_from={resumed['step']} "
        f"crash_after={killed_after} then_resumed_from={again['step']} "
        f"seconds_to_resumed={resumed_seconds:.1f} wall={time.monotonic() - started:.1f}"
    )
