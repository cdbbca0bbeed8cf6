"""End to end: a Hugging Face Transformers `Trainer` job, checkpointed by Cairn.

`examples/hf_trainer.py` (a tiny GPT-2 built from a config, the Trainer's own
loop and data order, `CairnTrainer`) runs as a TrainingJob with the real
operator process, real pods (the node agent), two gloo ranks (DDP) and the
real S3 server:

- STEP, COMMITTED and UPLOADED fill while attempt 1 runs, RESUMED-FROM while
  attempt 2 runs (the library's status feed; nothing in the script);
- rank 1 SIGKILLed once step 10 is committed: one gang restart, attempt 2
  resumes from the newest step that survived and finishes at the last step;
- every logged step's loss, the final one included, is bit-identical to an
  undisturbed run of the same script (torchrun, 2 ranks, no operator): the
  model, optimizer, scheduler, RNG states and trainer state (data position)
  all come back.

One job plus one local run, about 1.5 minutes on 2 cores.
"""

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from tests import demo
from tests.e2e import killedjob

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.timeout(600)]

# The Trainer needs Accelerate (transformers[torch]); without it nothing here can run.

SCRIPT = demo.REPO / "examples" / "hf_trainer.py"
STEPS = 30
INTERVAL = 5
KILL_AFTER_COMMIT = 10


def undisturbed_losses(workdir: pathlib.Path) -> dict[str, float]:
    """The same script, STEPS steps straight under torchrun (2 ranks, no operator)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CAIRN_", "PET_"))}
    env |= {
        "CAIRN_CHECKPOINT_DIR": str(workdir / "checkpoints"),
        "CAIRN_CHECKPOINT_INTERVAL_STEPS": str(INTERVAL),
        "CAIRN_RESUME_FROM": "none",
        "TMPDIR": str(workdir),
        "TORCHINDUCTOR_CACHE_DIR": str(workdir / "inductor"),
        # Bit equality needs the same intra-op thread count on both sides
        # (it changes the order of float reductions).
        "OMP_NUM_THREADS": "1",
    }
    out = workdir / "undisturbed.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(SCRIPT), "--steps", str(STEPS)]
    command += ["--losses-out", str(out)]
    done = subprocess.run(
        command, check=False, env=env, cwd=workdir, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    losses: dict[str, float] = json.loads(out.read_text())
    return losses


def test_trainer_job_resumes_after_a_killed_rank_with_identical_losses(
    devcluster: Any, space: tuple[str, str], tmp_path: pathlib.Path
) -> None:
    namespace, bucket = space
    expected = undisturbed_losses(tmp_path)
    assert sorted(map(int, expected)) == list(range(1, STEPS + 1))

    # The pods are local processes here: they write their losses to this folder.
    shared = tmp_path / "job"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    body = demo.quickstart_manifest(devcluster.target, name="hf-trainer")
    spec = body["spec"]
    spec["command"] = ["python", str(SCRIPT)]
    spec["args"] = ["--steps", str(STEPS), "--step-delay", "0.4"]
    spec["args"] += ["--losses-out", str(shared / "losses.json")]
    spec["args"] += ["--output-dir", str(shared / "output")]
    spec["env"] = [{"name": "OMP_NUM_THREADS", "value": "1"}]
    spec["resources"]["limits"]["memory"] = "2Gi"
    spec["checkpoint"]["intervalSteps"] = INTERVAL
    spec["checkpoint"]["statusIntervalSeconds"] = 1  # STEP moves while it runs
    spec["checkpoint"]["upload"]["uri"] = f"s3://{bucket}/hf-trainer"
    run = killedjob.run_with_a_killed_rank(
        api_client=devcluster.api_client,
        namespace=namespace,
        body=body,
        kill_after_commit=KILL_AFTER_COMMIT,
        timeout=480,
    )
    assert any(r.uploaded is not None for r in run.first), "UPLOADED never filled"
    killedjob.check_resumed_to_the_end(
        run.status, interval=INTERVAL, kill_after_commit=KILL_AFTER_COMMIT, steps=STEPS
    )

    # Attempt 2's log history: the restored steps' entries plus its own.
    losses = json.loads((shared / "losses.json").read_text())
    print(f"    final loss: job {losses[str(STEPS)]!r}, undisturbed {expected[str(STEPS)]!r}")
    assert losses == expected, {k: (losses.get(k), v) for k, v in expected.items()}
