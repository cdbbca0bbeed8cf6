"""``kubectl cairn`` against the devcluster's real API server.

Covers: ``checkpoints`` (history merged with lastCommitted/lastUploaded and
in-flight steps, as a table and as JSON); ``describe`` (phase, progress,
checkpoints, last failure, pods, conditions); ``resume --from-step`` on a
running job (suspend + edit, then, once the job reports Suspended at that
generation, unsuspend: merge patches of only ``spec.suspend``,
``spec.checkpoint.resume`` and the resume-request annotation accepted by the
CRD's CEL transition rules, owned by the ``kubectl-cairn`` field manager; the
other one-of forms cleared), a running job that never gets Suspended (a
clear error, left suspended with the target), and with ``--keep-suspended``
on a suspended job; refusing a finished job and a step that is not
committed (rotated, corrupt, unknown: the job untouched);
``logs`` of the current attempt (all ranks prefixed, one ``--rank``, an
older ``--attempt``) from real pods run by the node agent, never a decoy
pod that only carries the job's labels (``describe`` lists it apart); ``logs -f``
streaming a running pod's lines until it ends (and refused without
``--rank`` when several pods match); a missing job;
and kubectl's plugin discovery running ``kubectl cairn`` from ``PATH``.
Test jobs carry ``spec.managedBy`` of another controller, so a Cairn
operator running on the cluster leaves them alone; the tests write status
themselves.
"""

import io
import json
import os
import pathlib
import stat
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from kubernetes.client.rest import ApiException

from cairn.api import checkpointspec
from cairn.kubectl_plugin import cli
from tests.conftest import DevclusterHandle
from tests.integration.devcluster import kube_helpers

from . import conftest

pytestmark = pytest.mark.cluster
RESUME_REQUEST = checkpointspec.RESUME_REQUEST_ANNOTATION

STATUS: dict[str, Any] = {
    "phase": "Running",
    "observedGeneration": 1,
    "attempt": 2,
    "restarts": 1,
    "restartsCountTowardsMax": 1,
    "startTime": "2026-11-22T12:00:00Z",
    "step": 57,
    "lastFailure": {
        "attempt": 1,
        "time": "2026-11-22T12:05:00Z",
        "reason": "RankFailed",
        "message": "attempt 1: rank 1 exited with code 1",
        "rank": 1,
        "exitCode": 1,
        "counted": True,
    },
    "checkpoints": {
        "lastCommitted": {"step": 50, "time": "2026-11-22T12:20:00Z", "bytes": 3 * 1024 * 1024},
        "lastUploaded": {
            "step": 40,
            "uri": "s3://cairn-test/job/step-000000040",
            "time": "2026-11-22T12:19:00Z",
            "bytes": 3 * 1024 * 1024,
            "verified": True,
        },
        "inFlight": [{"step": 55, "stage": "writing", "since": "2026-11-22T12:21:00Z"}],
        "history": [
            {"step": 20, "state": "rotated", "time": "2026-11-22T12:10:00Z", "bytes": 3145728},
            {"step": 30, "state": "verified", "time": "2026-11-22T12:15:00Z", "bytes": 3145728},
            {"step": 40, "state": "uploaded", "time": "2026-11-22T12:19:00Z", "bytes": 3145728},
            {"step": 45, "state": "corrupt", "time": "2026-11-22T12:19:30Z", "message": "bad sum"},
        ],
        "resumedFrom": {"step": 10, "attempt": 2, "source": "remote"},
    },
    "conditions": [
        {
            "type": "Ready",
            "status": "True",
            "observedGeneration": 1,
            "lastTransitionTime": "2026-11-22T12:06:00Z",
            "reason": "Running",
            "message": "attempt 2: all 2 pod(s) running",
        }
    ],
}


def run(handle: DevclusterHandle, namespace: str, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.main(["--kubeconfig", str(handle.kubeconfig), "-n", namespace, *args], out=out)
    return code, out.getvalue()


@pytest.fixture
def running_job(devcluster: DevclusterHandle, namespace: str) -> str:
    conftest.create_job(devcluster, namespace, "llm")
    conftest.patch_status(devcluster, namespace, "llm", STATUS)
    return "llm"


def test_checkpoints_table(devcluster: DevclusterHandle, namespace: str, running_job: str) -> None:
    code, out = run(devcluster, namespace, "checkpoints", running_job)
    assert code == 0
    header, *rows = out.splitlines()
    assert header.split() == ["STEP", "STATE", "SIZE", "AGE", "LOCAL", "REMOTE", "VERIFIED"]
    cells = {int(r.split()[0]): r.split() for r in rows}
    assert list(cells) == [55, 50, 45, 40, 30, 20]
    assert cells[55][1:2] + cells[55][4:] == ["writing", "writing", "-", "-"]
    assert cells[50][1:3] + cells[50][4:] == ["committed", "3.0MiB", "yes", "-", "-"]
    assert cells[45][1] == "corrupt" and cells[45][4] == "corrupt"
    # lastUploaded says step 40 was verified; the history record is older news.
    assert cells[40][1] == "uploaded" and cells[40][4:] == ["yes", "yes", "yes"]
    assert cells[30][4:] == ["yes", "yes", "yes"]
    assert cells[20][1] == "rotated" and cells[20][4:] == ["no", "-", "-"]


def test_checkpoints_json(devcluster: DevclusterHandle, namespace: str, running_job: str) -> None:
    code, out = run(devcluster, namespace, "checkpoints", running_job, "-o", "json")
    assert code == 0
    rows = json.loads(out)
    assert rows[1] == {
        "step": 50,
        "state": "committed",
        "bytes": 3145728,
        "time": "2026-11-22T12:20:00+00:00",
        "local": "yes",
        "remote": "-",
        "verified": False,
    }


def test_checkpoints_of_a_new_job(devcluster: DevclusterHandle, namespace: str) -> None:
    conftest.create_job(devcluster, namespace, "fresh")
    assert run(devcluster, namespace, "checkpoints", "fresh") == (
        0,
        "trainingjob fresh: no checkpoints yet\n",
    )


def test_describe(devcluster: DevclusterHandle, namespace: str, running_job: str) -> None:
    code, out = run(devcluster, namespace, "describe", running_job)
    assert code == 0
    assert f"Name:          {namespace}/llm" in out
    assert "Phase:         Running" in out
    assert "Attempt:       2   restarts 1 (1 counted)" in out
    assert "Committed:     step 50, 3.0MiB" in out
    assert "Uploaded:      step 40 to s3://cairn-test/job/step-000000040 (verified)" in out
    assert "Resumed from:  step 10 (remote)" in out
    assert "In flight:     step 55 writing" in out
    assert "Last failure:  attempt 1: RankFailed: attempt 1: rank 1 exited with code 1" in out
    assert "Ready   True" in out


def _act_as_operator_on_suspend(devcluster: DevclusterHandle, namespace: str, name: str) -> None:
    """What the operator does once it sees spec.suspend: report Suspended at that generation."""
    api = conftest.custom(devcluster)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        job = api.get_namespaced_custom_object(
            "cairn.dev", "v1alpha1", namespace, "trainingjobs", name
        )
        if job["spec"].get("suspend"):
            generation = job["metadata"]["generation"]
            status = {"phase": "Suspended", "observedGeneration": generation}
            conftest.patch_status(devcluster, namespace, name, status)
            return
        time.sleep(0.2)


def test_resume_running_job(devcluster: DevclusterHandle, namespace: str, running_job: str) -> None:
    operator = threading.Thread(
        target=_act_as_operator_on_suspend, args=(devcluster, namespace, running_job)
    )
    operator.start()
    try:
        code, out = run(devcluster, namespace, "resume", running_job, "--from-step", "30")
    finally:
        operator.join()
    assert (code, out) == (
        0,
        f"trainingjob.cairn.dev/{running_job} patched: resume from step 30, resuming"
        " (field manager kubectl-cairn)\n",
    )
    job = conftest.custom(devcluster).get_namespaced_custom_object(
        "cairn.dev", "v1alpha1", namespace, "trainingjobs", running_job
    )
    assert job["spec"]["checkpoint"]["resume"] == {"step": 30}
    assert job["spec"]["suspend"] is False
    assert job["metadata"]["generation"] == 3  # suspend+edit, then unsuspend once Suspended
    assert RESUME_REQUEST in job["metadata"]["annotations"]
    ours = [m for m in job["metadata"]["managedFields"] if m["manager"] == "kubectl-cairn"]
    assert len(ours) == 1
    owned = ours[0]["fieldsV1"]["f:spec"]
    assert set(owned) == {"f:suspend", "f:checkpoint"}
    assert set(owned["f:checkpoint"]) == {"f:resume"}


def test_resume_running_job_that_never_suspends_says_so(
    devcluster: DevclusterHandle,
    namespace: str,
    running_job: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out = run(
        devcluster, namespace, "resume", running_job, "--from-step", "30", "--timeout", "1"
    )
    assert (code, out) == (1, "")
    err = capsys.readouterr().err
    assert "is suspending with resume step 30 set, but not Suspended within 1s" in err
    job = conftest.custom(devcluster).get_namespaced_custom_object(
        "cairn.dev", "v1alpha1", namespace, "trainingjobs", running_job
    )
    # Left in a consistent state: suspended, with the target for the next attempt.
    assert job["spec"]["suspend"] is True
    assert job["spec"]["checkpoint"]["resume"] == {"step": 30}


@pytest.mark.parametrize("step", ["20", "45", "99"], ids=["rotated", "corrupt", "unknown"])
def test_resume_refuses_a_step_that_is_not_committed(
    devcluster: DevclusterHandle,
    namespace: str,
    running_job: str,
    capsys: pytest.CaptureFixture[str],
    step: str,
) -> None:
    api = conftest.custom(devcluster)
    before = api.get_namespaced_custom_object(
        "cairn.dev", "v1alpha1", namespace, "trainingjobs", running_job
    )
    assert run(devcluster, namespace, "resume", running_job, "--from-step", step) == (1, "")
    assert f"step {step} is not a committed checkpoint of trainingjob llm" in (
        capsys.readouterr().err
    )
    after = api.get_namespaced_custom_object(
        "cairn.dev", "v1alpha1", namespace, "trainingjobs", running_job
    )
    assert after["spec"] == before["spec"]
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert RESUME_REQUEST not in (after["metadata"].get("annotations") or {})


def test_resume_edit_without_suspend_is_what_the_crd_rejects(
    devcluster: DevclusterHandle, namespace: str, running_job: str
) -> None:
    # Why the plugin suspends in the same patch: checkpoint is run-defining.
    with pytest.raises(ApiException, match="suspend"):
        conftest.custom(devcluster).patch_namespaced_custom_object(
            "cairn.dev",
            "v1alpha1",
            namespace,
            "trainingjobs",
            running_job,
            {"spec": {"checkpoint": {"resume": {"step": 30, "latest": None}}}},
            _content_type="application/merge-patch+json",
        )


def test_resume_keep_suspended(devcluster: DevclusterHandle, namespace: str) -> None:
    conftest.create_job(devcluster, namespace, "parked", suspend=True)
    conftest.patch_status(
        devcluster,
        namespace,
        "parked",
        {"phase": "Suspended", "checkpoints": {"lastCommitted": {"step": 7}}},
    )
    code, out = run(
        devcluster, namespace, "resume", "parked", "--from-step", "7", "--keep-suspended"
    )
    assert code == 0 and "left suspended" in out
    job = conftest.custom(devcluster).get_namespaced_custom_object(
        "cairn.dev", "v1alpha1", namespace, "trainingjobs", "parked"
    )
    assert job["spec"]["suspend"] is True
    assert job["spec"]["checkpoint"]["resume"] == {"step": 7}


def test_resume_refuses_a_finished_job(
    devcluster: DevclusterHandle, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    conftest.create_job(devcluster, namespace, "done")
    conftest.patch_status(devcluster, namespace, "done", {"phase": "Succeeded"})
    assert run(devcluster, namespace, "resume", "done", "--from-step", "7") == (1, "")
    assert "trainingjob done is Succeeded: a finished job does not start again" in (
        capsys.readouterr().err
    )


def test_missing_job(
    devcluster: DevclusterHandle, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(devcluster, namespace, "describe", "nope") == (1, "")
    assert f'trainingjob "nope" not found in namespace "{namespace}"' in capsys.readouterr().err


def _job_uid(handle: DevclusterHandle, namespace: str, job: str) -> str:
    found = conftest.custom(handle).get_namespaced_custom_object(
        "cairn.dev", "v1alpha1", namespace, "trainingjobs", job
    )
    return str(found["metadata"]["uid"])


def _rank_pod(
    job: str, attempt: int, rank: int, *, uid: str | None, name: str | None = None
) -> dict[str, Any]:
    """A pod of the job's attempt and rank, as the operator makes it (controller
    ownerReference = the job, the operator's name); `uid` None: a decoy with
    the labels only."""
    pod = kube_helpers.python_pod(
        name or f"{job}-a{attempt}-n{rank}",
        f"print('attempt {attempt} rank {rank} line 1'); print('attempt {attempt} rank {rank} line 2')",
        container={"name": "trainer"},
    )
    pod["metadata"]["labels"] = {
        "cairn.dev/job-name": job,
        "cairn.dev/attempt": str(attempt),
        "cairn.dev/rank": str(rank),
    }
    if uid is not None:
        pod["metadata"]["ownerReferences"] = [
            {
                "apiVersion": "cairn.dev/v1alpha1",
                "kind": "TrainingJob",
                "name": job,
                "uid": uid,
                "controller": True,
            }
        ]
    return pod


@pytest.fixture
def finished_pods(devcluster: DevclusterHandle, namespace: str, running_job: str) -> str:
    names = []
    uid = _job_uid(devcluster, namespace, running_job)
    for attempt, rank in ((1, 0), (2, 0), (2, 1)):
        pod = _rank_pod(running_job, attempt, rank, uid=uid)
        devcluster.core.create_namespaced_pod(namespace, pod)
        names.append(pod["metadata"]["name"])
    # A decoy: the current attempt's labels, not the job's pod. Never shown as a rank.
    decoy = _rank_pod(running_job, 2, 0, uid=None, name=f"{running_job}-decoy")
    decoy["spec"]["containers"][0]["command"] = ["python", "-c", "print('decoy says hi')"]
    devcluster.core.create_namespaced_pod(namespace, decoy)
    names.append(decoy["metadata"]["name"])
    for name in names:

        def succeeded(pod_name: str = name) -> bool:
            return kube_helpers.pod_phase(devcluster.core, pod_name, namespace) == "Succeeded"

        kube_helpers.wait_for(succeeded, timeout=60, what=f"pod {name} to succeed")
    return running_job


def test_logs_of_current_attempt(
    devcluster: DevclusterHandle,
    namespace: str,
    finished_pods: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out = run(devcluster, namespace, "logs", finished_pods)
    assert code == 0
    assert "ignored pod llm-decoy (it has no controller ownerReference)" in capsys.readouterr().err
    assert out.splitlines() == [
        "[rank 0] attempt 2 rank 0 line 1",
        "[rank 0] attempt 2 rank 0 line 2",
        "[rank 1] attempt 2 rank 1 line 1",
        "[rank 1] attempt 2 rank 1 line 2",
    ]
    assert run(devcluster, namespace, "logs", finished_pods, "--rank", "1", "--tail", "1") == (
        0,
        "attempt 2 rank 1 line 2\n",
    )
    assert run(devcluster, namespace, "logs", finished_pods, "--attempt", "1") == (
        0,
        "attempt 1 rank 0 line 1\nattempt 1 rank 0 line 2\n",
    )
    _, described = run(devcluster, namespace, "describe", finished_pods)
    assert "llm-a2-n1   2         1      Succeeded" in described
    # The decoy (labels of attempt 2 rank 0, no ownerReference): listed apart, never a rank.
    pods_section = described.split("Pods:", 1)[1].split("Not the job's", 1)[0]
    assert "llm-decoy" not in pods_section
    assert "llm-decoy (it has no controller ownerReference)" in described


def test_kubectl_finds_the_plugin_on_path(
    devcluster: DevclusterHandle, namespace: str, running_job: str, tmp_path: pathlib.Path
) -> None:
    # What the console script `kubectl-cairn` will be once pyproject declares it.
    shim = tmp_path / "kubectl-cairn"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m cairn.kubectl_plugin "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    env = {
        **os.environ,
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
        "PYTHONPATH": str(conftest.PLUGIN_ROOT),
        "KUBECONFIG": str(devcluster.kubeconfig),
    }
    result = subprocess.run(
        [str(conftest.KUBECTL), "cairn", "-n", namespace, "checkpoints", running_job],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].split()[:2] == ["STEP", "STATE"]
    assert len(result.stdout.splitlines()) == 7


class _StampedOut(io.StringIO):
    """Output that records, for each line written, whether the pod still ran then."""

    def __init__(self, on_line: Any) -> None:
        super().__init__()
        self.on_line = on_line

    def write(self, text: str) -> int:
        for line in text.splitlines():
            self.on_line(line)
        return super().write(text)


def test_logs_follow_streams_until_the_pod_ends(
    devcluster: DevclusterHandle, namespace: str, running_job: str
) -> None:
    """``logs -f``: lines arrive while the pod runs (streamed, not collected at its
    end) and the command returns 0 once the pod ends; with several pods it
    refuses and says to pick a ``--rank``."""
    conftest.patch_status(devcluster, namespace, running_job, {"attempt": 3})
    for rank, script in (
        (0, "import time; print('first', flush=True); time.sleep(6); print('last', flush=True)"),
        (1, "print('other rank')"),
    ):
        pod = _rank_pod(running_job, 3, rank, uid=_job_uid(devcluster, namespace, running_job))
        pod["spec"]["containers"][0]["command"] = ["python", "-c", script]
        devcluster.core.create_namespaced_pod(namespace, pod)
    name = f"{running_job}-a3-n0"

    def running() -> bool:
        return kube_helpers.pod_phase(devcluster.core, name, namespace) == "Running"

    kube_helpers.wait_for(running, timeout=60, what=f"pod {name} to run")
    assert run(devcluster, namespace, "logs", running_job, "-f") == (
        2,
        "--follow needs one pod: pass --rank\n",
    )
    seen: list[tuple[str, str]] = []
    out = _StampedOut(
        lambda line: seen.append(
            (line, str(kube_helpers.pod_phase(devcluster.core, name, namespace)))
        )
    )
    args = ["--kubeconfig", str(devcluster.kubeconfig), "-n", namespace]
    code = cli.main([*args, "logs", running_job, "--rank", "0", "-f"], out=out)
    assert code == 0
    assert [line for line, _ in seen] == ["first", "last"]
    assert seen[0][1] == "Running", seen  # streamed while the pod still ran
    assert kube_helpers.pod_phase(devcluster.core, name, namespace) == "Succeeded"
