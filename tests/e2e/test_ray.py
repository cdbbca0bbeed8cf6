"""End to end: the Ray runtime on the devcluster (examples/quickstart-ray.yaml).

Covers, with the real operator, real pods (a Ray head and a Ray worker
started by ``cairn.trainer.raynode``), the Ray driver and the reference
trainer, and the real S3 server, in a restricted-PSS namespace:

- a rank actor's process SIGKILLed mid-training → in-place recovery: the job
  Succeeds in attempt 1 with no pod recreated (same pod names and UIDs),
  ``status.ray.inPlaceRestarts`` 1 and group 1, one ``InPlaceRestart`` Event,
  steps committed, uploaded and verified in status as under torchrun, every
  uploaded file's CRC32C checking out;
- the worker pod's process SIGKILLed → gang restart (attempt 2,
  ``status.ray.group`` back to 0) that resumes from a committed step;
- the worker pod deleted (a drain) → only it is replaced, in attempt 1
  (``status.podReplacements``, one ``ReplacingPod`` Warning, the head's UID
  kept); the driver waits for the new Ray node, places the group again, and
  the new rank restores its shard from its peer's memory replica;
- suspend → final checkpoint → Suspended → resume → Succeeded;
- in all four, the exported weights are bit-identical to an undisturbed
  torchrun run of the same trainer and arguments, and so is every step's loss
  (the torchrun run with ``OMP_NUM_THREADS=1``, as Ray gives a 1-CPU actor).
"""

import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

from tests import demo
from tests.e2e import rayjobs

pytestmark = [pytest.mark.e2e, pytest.mark.cluster]

FINAL_STEP = 40
RECOVERY_TIMEOUT = 240.0
"""A lost pod's deadline to training again (a hang is a failure)."""
LOST_STEP_DELAY = 0.6
RUN_TIMEOUT = 900.0
VERIFY_TIMEOUT = 180.0


class Run:
    """One job of these tests in its own namespace and bucket."""

    def __init__(self, devcluster: Any, *, runtime: str, name: str) -> None:
        self.devcluster = devcluster
        self.namespace = f"e2e-ray-{uuid.uuid4().hex[:8]}"
        self.bucket = f"e2e-ray-{uuid.uuid4().hex[:8]}"
        demo.prepare_namespace(
            api_client=devcluster.api_client,
            target=devcluster.target,
            namespace=self.namespace,
            bucket=self.bucket,
        )
        self.core = client.CoreV1Api(devcluster.api_client)
        self.custom = client.CustomObjectsApi(devcluster.api_client)
        self.body = rayjobs.manifest(
            devcluster.target, name=name, runtime=runtime, bucket=self.bucket
        )
        self.name = name
        self.rows: list[demo.Row] = []

    def run(self, on_poll: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        job = demo.run_job(
            api_client=self.devcluster.api_client,
            namespace=self.namespace,
            body=self.body,
            kill_rank_after_commit=None,
            on_row=self.rows.append,
            timeout=RUN_TIMEOUT,
            on_poll=on_poll,
        )
        return job

    def head(self, job: dict[str, Any]) -> str:
        return rayjobs.head_pod(job)

    def weights(self, job: dict[str, Any]) -> bytes:
        return rayjobs.exported(self.devcluster.state_dir, self.namespace, self.head(job))

    def losses(self, job: dict[str, Any]) -> dict[int, float]:
        return rayjobs.losses(self.devcluster.state_dir, self.namespace, self.head(job))

    def events(self, reason: str) -> list[Any]:
        items = self.core.list_namespaced_event(
            self.namespace,
            field_selector=f"involvedObject.kind=TrainingJob,involvedObject.name={self.name}",
        ).items
        return [e for e in items if e.reason == reason]

    def close(self) -> None:
        self.core.delete_namespace(self.namespace)


@pytest.fixture(scope="module")
def baseline(devcluster: Any, operator_process: Any) -> Any:
    """An undisturbed torchrun run of the same trainer: (losses, weights)."""
    operator_process.ensure_running()
    run = Run(devcluster, runtime="torchrun", name="baseline")
    job = run.run()
    assert job["status"]["phase"] == "Succeeded", job["status"]
    assert job["status"]["restarts"] == 0
    result = run.losses(job), run.weights(job)
    run.close()
    return result


def _uploads_verify(run: Run, job: dict[str, Any]) -> None:
    """Status shows the final step committed, uploaded, verified; S3 agrees."""
    ckpts = job["status"]["checkpoints"]
    assert ckpts["lastCommitted"]["step"] == FINAL_STEP
    assert ckpts["lastUploaded"]["step"] == FINAL_STEP
    prefix = job["spec"]["checkpoint"]["upload"]["uri"].removeprefix(f"s3://{run.bucket}/")
    # The operator's S3 pass runs beside the lifecycle: verified, and done
    # rotating, possibly shortly after Succeeded.
    demo.assert_s3_steps_verify(
        custom=run.custom,
        target=run.devcluster.target,
        namespace=run.namespace,
        name=run.name,
        bucket=run.bucket,
        prefix=prefix,
        final_step=FINAL_STEP,
        timeout=VERIFY_TIMEOUT,
    )


def _same_as_baseline(
    baseline: tuple[dict[int, float], bytes], losses: dict[int, float], weights: bytes
) -> None:
    straight, straight_weights = baseline
    assert weights == straight_weights, "exported weights differ from the torchrun run"
    assert losses, "no losses recorded"
    assert {step: straight[step] for step in losses} == losses


def _committed(job: dict[str, Any]) -> int | None:
    """status.checkpoints.lastCommitted.step (None before the first commit)."""
    status = job.get("status") or {}
    step = ((status.get("checkpoints") or {}).get("lastCommitted") or {}).get("step")
    return None if step is None else int(step)


def _running_past(job: dict[str, Any], step: int) -> bool:
    """Running with a commit at or after `step`: a disturbance now has work to lose."""
    return (job.get("status") or {}).get("phase") == "Running" and (_committed(job) or 0) >= step


@pytest.mark.timeout(1500)
def test_rank_actor_killed_recovers_in_place(devcluster: Any, operator: Any, baseline: Any) -> None:
    run = Run(devcluster, runtime="ray", name="inplace")
    run.body["spec"]["checkpoint"]["memory"] = dict(rayjobs.MEMORY_TIER)
    seen: dict[str, Any] = {}

    def kill_an_actor(job: dict[str, Any]) -> None:
        if "killed" in seen or not _running_past(job, 10):
            return
        groups = rayjobs.group_pids(run.core, run.namespace, run.head(job))
        if 0 not in groups:
            return
        # Only between two steps' memory copies: a kill while a rank keeps the
        # newest step leaves that step on the volume only, and the new group
        # rightly restores it from there (seen once: tier local, not memory).
        uids = rayjobs.pod_uids(run.core, run.namespace, run.name)
        pods = [f"{run.name}-a{job['status']['attempt']}-n{n}" for n in (0, 1)]
        copies = rayjobs.memory_copies(devcluster.state_dir, run.namespace, pods) or {}
        newest = {steps[-1] if steps else 0 for steps in copies.values()}
        if sorted(copies) != [0, 1] or len(newest) != 1 or min(newest) < (_committed(job) or 0):
            return
        rayjobs.kill(groups[0][1])  # right after the check: the next keep is ~1 s away
        seen["uids"], seen["killed"] = uids, groups[0][1]

    job = run.run(kill_an_actor)
    status = job["status"]
    assert status["phase"] == "Succeeded", status
    assert "killed" in seen, "never reached a commit to kill after"
    assert (status["attempt"], status["restarts"]) == (1, 0)
    assert rayjobs.pod_uids(run.core, run.namespace, run.name) == seen["uids"]
    assert status["ray"]["inPlaceRestarts"] == 1 and status["ray"]["group"] == 1
    assert status["ray"]["lastInPlaceRestart"]["fromStep"] >= 10
    # The new actors loaded the step from pod memory (the volume holds it too).
    resumed = status["checkpoints"]["resumedFrom"]
    assert (resumed["attempt"], resumed["tier"]) == (1, "memory"), resumed
    assert resumed["step"] == status["ray"]["lastInPlaceRestart"]["fromStep"], resumed
    (event,) = run.events("InPlaceRestart")
    assert "rank-actor group 1" in event.message
    groups = rayjobs.group_pids(run.core, run.namespace, run.head(job))
    assert sorted(groups) == [0, 1] and seen["killed"] not in groups[1]
    _uploads_verify(run, job)
    _same_as_baseline(baseline, run.losses(job), run.weights(job))
    run.close()


@pytest.mark.timeout(1500)
def test_worker_pod_killed_restarts_the_gang(devcluster: Any, operator: Any, baseline: Any) -> None:
    run = Run(devcluster, runtime="ray", name="gang")
    seen: dict[str, Any] = {}

    def kill_the_worker_pod(job: dict[str, Any]) -> None:
        if "killed" in seen or not _running_past(job, 10):
            return
        pid = demo.kill_rank(run.core, namespace=run.namespace, job=run.name, rank=1)
        if pid is not None:
            seen["killed"] = pid

    job = run.run(kill_the_worker_pod)
    status = job["status"]
    assert status["phase"] == "Succeeded", status
    assert (status["attempt"], status["restarts"]) == (2, 1)
    assert status["lastFailure"]["rank"] == 1 and status["lastFailure"]["exitCode"] == 137
    assert status["ray"]["group"] == 0
    assert status["checkpoints"]["resumedFrom"]["step"] >= 10
    _uploads_verify(run, job)
    _same_as_baseline(baseline, run.losses(job), run.weights(job))
    run.close()


@pytest.mark.timeout(1500)
def test_lost_worker_pod_is_replaced_in_place(
    devcluster: Any, operator: Any, baseline: Any
) -> None:
    """The worker pod deleted (as a drain or an eviction through the API does):
    only it is replaced, in attempt 1; the driver waits for the new Ray node,
    places the group again and its rank restores from its peer's memory."""
    run = Run(devcluster, runtime="ray", name="lost")
    run.body["spec"]["checkpoint"]["memory"] = dict(rayjobs.MEMORY_TIER)
    # Slower steps (the same losses and weights): the loss must land while
    # there is training left after it (its SIGTERM, the 5 s lone-loss window
    # and Ray's drain take ~8 s; at 0.2 s a step the job had finished).
    args = run.body["spec"]["args"]
    args[args.index("--step-delay") + 1] = str(LOST_STEP_DELAY)
    worker = f"{run.name}-a1-n1"
    seen: dict[str, Any] = {}
    tiers: list[str] = []

    def lose_the_worker_pod(job: dict[str, Any]) -> None:
        resumed = (job.get("status") or {}).get("checkpoints", {}).get("resumedFrom") or {}
        if "lost" in seen and resumed.get("tier") and resumed.get("tier") not in tiers:
            tiers.append(resumed["tier"])
        if "lost" in seen or not _running_past(job, 10):
            return
        uids = rayjobs.pod_uids(run.core, run.namespace, run.name)
        if worker not in uids:
            return
        seen.update(
            uids=uids, lost=uids[worker], group=(job["status"].get("ray") or {}).get("group") or 0
        )
        head = run.head(job)
        lines = rayjobs.loss_lines(devcluster.state_dir, run.namespace, head)
        lost_at = time.monotonic()
        run.core.delete_namespaced_pod(worker, run.namespace)  # graceful, as a drain
        lines = max(
            lines,
            rayjobs.lines_once_new_group(
                run.custom,
                devcluster.state_dir,
                run.namespace,
                run.name,
                head,
                after=rayjobs.in_place_restarts(job, runtime="ray"),
                deadline=lost_at + RECOVERY_TIMEOUT,
                poll_seconds=0.2,
                runtime="ray",
            ),
        )
        stepped = rayjobs.wait_new_step(
            devcluster.state_dir, run.namespace, head, after_lines=lines, timeout=RECOVERY_TIMEOUT
        )
        seen["mttr"] = stepped - lost_at

    job = run.run(lose_the_worker_pod)
    status = job["status"]
    assert status["phase"] == "Succeeded", status
    assert "lost" in seen, "never reached a commit to lose the pod after"
    assert (status["attempt"], status["restarts"]) == (1, 0), status
    assert not any(r.phase == "Restarting" for r in run.rows), [r.line() for r in run.rows]
    (replaced,) = status["podReplacements"]
    assert (replaced["rank"], replaced["lostPodUid"]) == (1, seen["lost"]), replaced
    assert replaced["replacementUid"] not in ("", seen["lost"]), replaced
    uids = rayjobs.pod_uids(run.core, run.namespace, run.name)
    assert uids[f"{run.name}-a1-n0"] == seen["uids"][f"{run.name}-a1-n0"]  # the head stayed
    assert uids[worker] == replaced["replacementUid"]
    (warning,) = run.events("ReplacingPod")
    assert warning.type == "Warning" and "maxInPlaceRestarts=" in warning.message, warning
    ray_status = status["ray"]
    assert ray_status["inPlaceRestarts"] >= 1 and ray_status["group"] > seen["group"]
    assert "Ray node is gone" in ray_status["lastInPlaceRestart"]["reason"], ray_status
    # Rank 1's shard came from its peer's memory replica: its own pod's memory
    # went with the pod (a memory restore says "peer" when any rank's did).
    assert "peer" in tiers, (tiers, status["checkpoints"].get("resumedFrom"))
    _uploads_verify(run, job)
    _same_as_baseline(baseline, run.losses(job), run.weights(job))
    print(f"    Ray worker pod lost: back to training after {seen['mttr']:.1f}s, tiers {tiers}")
    run.close()


@pytest.mark.timeout(1500)
def test_suspend_final_checkpoint_resume(devcluster: Any, operator: Any, baseline: Any) -> None:
    run = Run(devcluster, runtime="ray", name="pause")
    seen: dict[str, Any] = {}

    def suspend_then_resume(job: dict[str, Any]) -> None:
        if "suspended" not in seen and _running_past(job, 10):
            seen["suspended"] = _committed(job)
            run.custom.patch_namespaced_custom_object(
                demo.GROUP,
                demo.VERSION,
                run.namespace,
                demo.PLURAL,
                run.name,
                {"spec": {"suspend": True}},
            )
        elif "resumed" not in seen and (job.get("status") or {}).get("phase") == "Suspended":
            seen["resumed"] = True
            seen["committed_at_suspended"] = _committed(job)
            run.custom.patch_namespaced_custom_object(
                demo.GROUP,
                demo.VERSION,
                run.namespace,
                demo.PLURAL,
                run.name,
                {"spec": {"suspend": False}},
            )

    job = run.run(suspend_then_resume)
    status = job["status"]
    assert status["phase"] == "Succeeded", status
    assert seen.get("resumed"), seen
    assert any(r.phase == "Suspended" for r in run.rows)
    # Attempt 2 resumed from the final checkpoint taken at SIGTERM: at or after
    # the commit seen when suspend was asked for (observed: the step the
    # SIGTERM interrupted, between two interval steps), and exactly the step
    # status showed committed once the job was Suspended (the driver waits for
    # rank 0's final report before it stops the actors).
    resumed = status["checkpoints"]["resumedFrom"]
    assert resumed["step"] >= seen["suspended"], (resumed, seen)
    assert resumed["step"] == seen["committed_at_suspended"], (resumed, seen)
    assert resumed["attempt"] == 2
    assert status["attempt"] == 2
    _uploads_verify(run, job)
    _same_as_baseline(baseline, run.losses(job), run.weights(job))
    run.close()
