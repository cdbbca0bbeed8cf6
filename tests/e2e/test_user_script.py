"""End to end: a user's own script (not the reference trainer) as a TrainingJob.

`examples/user_trainer.py` is written from docs/trainer.md alone (an FSDP2
MLP, AdamW, StepLR, `runtime_config.from_env()`, `CheckpointManager`,
`restore`, `save`) and imports `cairn.checkpoint` only, never
`cairn.trainer`. With the real operator process, real pods (the node
agent), two gloo ranks and the real S3 server:

- the status feed comes from the library: STEP and COMMITTED fill while
  attempt 1 runs, UPLOADED while the job runs, RESUMED-FROM while attempt 2
  runs;
- rank 1 SIGKILLed once a step is committed: the job restarts once and
  attempt 2 resumes from the newest step that survived (committed and
  uploaded: the emptyDir volumes go with the pods), never an older one than
  attempt 1 reported uploaded, and finishes at the last step.

One job, about a minute on 2 cores.
"""

import ast
from typing import Any

import pytest

from tests import demo

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.timeout(600)]

SCRIPT = demo.REPO / "examples" / "user_trainer.py"
STEPS = 30
INTERVAL = 5
KILL_AFTER_COMMIT = 10


def test_the_script_imports_no_cairn_trainer() -> None:
    """The example is a plain user of the library (the issue's wording)."""
    imported: set[str] = set()
    for node in ast.walk(ast.parse(SCRIPT.read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert "cairn.checkpoint" in imported
    assert not [name for name in imported if name.startswith("cairn.trainer")]


def test_user_script_reports_status_and_resumes_after_a_killed_rank(
    devcluster: Any, space: tuple[str, str]
) -> None:
    namespace, bucket = space
    body = demo.quickstart_manifest(devcluster.target, name="user-script")
    spec = body["spec"]
    spec["command"] = ["python", str(SCRIPT)]
    spec["args"] = ["--steps", str(STEPS), "--step-delay", "0.3"]
    spec["checkpoint"]["intervalSteps"] = INTERVAL
    spec["checkpoint"]["statusIntervalSeconds"] = 1  # STEP moves while it runs
    spec["checkpoint"]["upload"]["uri"] = f"s3://{bucket}/user-script"
    rows: list[demo.Row] = []
    job = demo.run_job(
        api_client=devcluster.api_client,
        namespace=namespace,
        body=body,
        kill_rank_after_commit=KILL_AFTER_COMMIT,
        on_row=rows.append,
        poll_seconds=0.5,
        timeout=540,
    )
    for row in rows:
        print("   ", row.line())

    status = job["status"]
    assert status["phase"] == "Succeeded", status
    assert status["restarts"] == 1, "exactly one gang restart (the killed rank)"
    first = [r for r in rows if r.phase == "Running" and r.attempt == 1]
    second = [r for r in rows if r.phase == "Running" and r.attempt == 2]
    # Every column filled while the script ran, from the library alone.
    assert any(r.step is not None and r.step > 0 for r in first), "STEP never filled"
    assert any(r.committed is not None for r in first), "COMMITTED never filled"
    # (Uploads may lag a commit, e.g. in an API brownout the remote commit
    # waits for the strict fence: any running attempt counts.)
    assert any(r.uploaded is not None for r in first + second), "UPLOADED never filled"
    assert any(r.resumed_from is not None for r in second), "RESUMED-FROM never filled"
    # The resume: the newest step that survived the kill (committed on every
    # rank and uploaded: emptyDir volumes go with the pods), never an older one.
    uploaded = max(r.uploaded or 0 for r in rows if r.attempt == 1)
    committed = max(r.committed or 0 for r in rows if r.attempt == 1)
    ckpts = status["checkpoints"]
    resumed = ckpts["resumedFrom"]["step"]
    assert committed >= KILL_AFTER_COMMIT
    assert resumed % INTERVAL == 0 and KILL_AFTER_COMMIT <= resumed < STEPS, resumed
    assert uploaded <= resumed <= committed + INTERVAL, (uploaded, committed, resumed)
    assert ckpts["resumedFrom"]["attempt"] == 2
    assert ckpts["lastCommitted"]["step"] == STEPS
    assert ckpts["lastUploaded"]["step"] == STEPS
    assert status["step"] == STEPS
