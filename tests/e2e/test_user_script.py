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
  attempt 1 reported uploaded, and finishes at the last step;
- the user's script gets the memory tier (`checkpoint.memory`) and S3 every
  second save (`upload.intervalSteps: 10`, saves every 5) from the spec
  alone: S3 holds only steps divisible by 10, and the manifests record the
  in-pod tiers (memory, peer, volume).

One job, about a minute on 2 cores.
"""

import ast
from typing import Any

import pytest

from cairn.api import manifest
from tests import demo
from tests.e2e import killedjob, rayjobs

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.timeout(600)]

SCRIPT = demo.REPO / "examples" / "user_trainer.py"
STEPS = 30
INTERVAL = 5
UPLOAD_INTERVAL = 10
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
    spec["checkpoint"]["upload"]["intervalSteps"] = UPLOAD_INTERVAL
    spec["checkpoint"]["memory"] = dict(rayjobs.MEMORY_TIER)
    run = killedjob.run_with_a_killed_rank(
        api_client=devcluster.api_client,
        namespace=namespace,
        body=body,
        kill_after_commit=KILL_AFTER_COMMIT,
        timeout=540,
    )
    # (Uploads may lag a commit, e.g. in an API brownout the remote commit
    # waits for the strict fence: any running attempt counts.)
    assert any(r.uploaded is not None for r in run.first + run.second), "UPLOADED never filled"
    # The resume: the newest step that survived the kill (committed on every
    # rank and uploaded: emptyDir volumes go with the pods), never an older one.
    uploaded = max(r.uploaded or 0 for r in run.rows if r.attempt == 1)
    committed = max(r.committed or 0 for r in run.rows if r.attempt == 1)
    assert committed >= KILL_AFTER_COMMIT
    resumed = killedjob.check_resumed_to_the_end(
        run.status, interval=INTERVAL, kill_after_commit=KILL_AFTER_COMMIT, steps=STEPS
    )
    assert uploaded <= resumed <= committed + INTERVAL, (uploaded, committed, resumed)
    # Only every second save went to S3 (the last one, 30, is one of them).
    listing = demo.s3_listing(devcluster.target, bucket=bucket, prefix="user-script")
    steps = sorted(
        int(folder.removeprefix("step-"))
        for folder, objects in listing.items()
        if manifest.MANIFEST_NAME in objects
    )
    assert steps and steps[-1] == STEPS and all(s % UPLOAD_INTERVAL == 0 for s in steps), steps
    key = f"user-script/{manifest.step_dir_name(STEPS)}/{manifest.MANIFEST_NAME}"
    body = devcluster.target.s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
    last = manifest.parse_manifest(body)
    assert last.tiers == ("memory", "peer", "volume"), last.tiers
