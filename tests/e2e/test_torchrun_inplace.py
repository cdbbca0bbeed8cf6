"""End to end: torchrun's in-place restarts (``spec.torchrun.maxInPlaceRestarts``).

One 2-node job, ``torchrun -m cairn.trainer.reference`` in each pod,
``maxInPlaceRestarts: 2``. Rank 1's worker PROCESS (torchrun's child, not
torchrun) is SIGKILLed three times, each after a new commit:

- kills 1 and 2: every pod's torchrun restarts its workers in place: the same
  pods (names, UIDs), attempt 1, no pod restart; rank 0 of the new worker group
  records ``status.torchrun.group`` and ``inPlaceRestarts``; one
  ``InPlaceRestart`` Event each; the new group resumes from a committed step;
- kill 3: the in-place budget is spent, torchrun exits non-zero and the
  operator restarts the pods (attempt 2, ``restarts`` 1), resetting
  ``status.torchrun.group`` to 0;
- the job Succeeds with the final step committed and uploaded.

Printed, not asserted: each kill's MTTR (kill -> the next line of rank 0's
step log, the losses file the trainer appends per step) in place and pod-level.
"""

import pathlib
import time
import uuid
from typing import Any

import pytest
from kubernetes import client

from tests import demo
from tests.e2e import rayjobs

pytestmark = [pytest.mark.e2e, pytest.mark.cluster]

STEPS = 60
IN_PLACE = 2
RUN_TIMEOUT = 900.0
RECOVERY_TIMEOUT = 300.0
"""A kill's deadline to reach the next training step (a hang fails the test)."""


def _resumed(status: dict[str, Any]) -> tuple[int, int]:
    resumed = status["checkpoints"]["resumedFrom"]
    return resumed["attempt"], resumed["step"]


def _manifest(target: Any, *, bucket: str) -> dict[str, Any]:
    body = rayjobs.manifest(target, name="inplace-tr", runtime="torchrun", bucket=bucket)
    spec = body["spec"]
    spec["command"] = ["torchrun", "-m", "cairn.trainer.reference"]
    args = spec["args"]
    args[args.index("--steps") + 1] = str(STEPS)
    spec["torchrun"] = {"maxInPlaceRestarts": IN_PLACE}
    return body


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in pathlib.Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _worker_pid(agent: int) -> int | None:
    """The trainer worker under the pod's torchrun agent (its cmdline has no torchrun)."""
    pending = _children(agent)
    while pending:
        pid = pending.pop(0)
        try:
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"cairn.trainer.reference" in cmdline and b"torchrun" not in cmdline:
            return pid
        pending += _children(pid)
    return None


class Killer:
    """The on_poll hook: three kills of rank 1's worker, each after a new commit."""

    def __init__(self, *, core: client.CoreV1Api, namespace: str, name: str, state: Any) -> None:
        self.core, self.namespace, self.name, self.state = core, namespace, name, state
        self.uids: dict[str, str] = {}
        self.killed: list[int] = []
        self.mttr: list[tuple[str, float]] = []

    def __call__(self, job: dict[str, Any]) -> None:
        status = job.get("status") or {}
        committed = ((status.get("checkpoints") or {}).get("lastCommitted") or {}).get("step")
        restarts = (status.get("torchrun") or {}).get("inPlaceRestarts") or 0
        count = len(self.killed)
        ready = (
            count < IN_PLACE + 1
            and status.get("phase") == "Running"
            and restarts == count  # the previous kill's group is recorded
            and (committed or 0) >= 10 * (count + 1)
        )
        if not ready:
            return
        agent = demo.rank_pid(self.core, namespace=self.namespace, job=self.name, rank=1)
        worker = None if agent is None else _worker_pid(agent)
        if worker is None:
            return
        uids = rayjobs.pod_uids(self.core, self.namespace, self.name)
        self.uids = self.uids or uids
        assert uids == self.uids, "an in-place restart replaced a pod"
        head = rayjobs.head_pod(job)
        lines = rayjobs.loss_lines(self.state, self.namespace, head)
        killed_at = rayjobs.kill(worker)
        self.killed.append(worker)
        kind = "in place" if count < IN_PLACE else "pod-level"
        next_head = head if count < IN_PLACE else f"{self.name}-a{status['attempt'] + 1}-n0"
        before = lines if next_head == head else 0
        deadline = killed_at + RECOVERY_TIMEOUT
        while rayjobs.loss_lines(self.state, self.namespace, next_head) <= before:
            assert time.monotonic() < deadline, (
                f"no training step {RECOVERY_TIMEOUT:.0f}s after kill"
            )
            time.sleep(rayjobs.POLL_SECONDS)
        self.mttr.append((kind, time.monotonic() - killed_at))
        demo.say(f"kill {count + 1} ({kind}, worker pid {worker}): MTTR {self.mttr[-1][1]:.1f}s")


def _events(core: client.CoreV1Api, namespace: str, name: str, reason: str) -> list[Any]:
    items = core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.kind=TrainingJob,involvedObject.name={name}"
    ).items
    return [e for e in items if e.reason == reason]


@pytest.mark.timeout(1200)
def test_worker_killed_restarts_in_place_then_pods(devcluster: Any, operator: Any) -> None:
    namespace = f"e2e-tr-{uuid.uuid4().hex[:8]}"
    bucket = f"e2e-tr-{uuid.uuid4().hex[:8]}"
    api = devcluster.api_client
    demo.prepare_namespace(
        api_client=api, target=devcluster.target, namespace=namespace, bucket=bucket
    )
    core = client.CoreV1Api(api)
    body = _manifest(devcluster.target, bucket=bucket)
    name = body["metadata"]["name"]
    killer = Killer(core=core, namespace=namespace, name=name, state=devcluster.state_dir)
    rows: list[demo.Row] = []
    started = time.monotonic()
    job = demo.run_job(
        api_client=api,
        namespace=namespace,
        body=body,
        kill_rank_after_commit=None,
        on_row=rows.append,
        timeout=RUN_TIMEOUT,
        on_poll=killer,
        poll_seconds=0.5,
    )
    for row in rows:
        print("   ", row.line())
    status = job["status"]
    assert status["phase"] == "Succeeded", status
    assert len(killer.killed) == IN_PLACE + 1, f"only {len(killer.killed)} kills happened"
    # Two in place (same pods, attempt 1), then one pod-level restart.
    assert (status["attempt"], status["restarts"]) == (2, 1)
    first = [r for r in rows if r.attempt == 1 and r.phase in ("Running", "Restarting")]
    assert all(r.restarts == 0 for r in first if r.phase == "Running")
    torchrun = status["torchrun"]
    # Known defect (docs/operator.md, "In-place restarts (torchrun)"): under c10d
    # a worker that ends before rank 0 has been seen to abort at interpreter exit
    # ("terminate called without an active exception", exit -6; 1 run in 3 here),
    # and torchrun restarts the group once more in place: it resumes from the
    # final step and ends. Tolerated only in that exact shape, and printed.
    extra = torchrun["inPlaceRestarts"] - IN_PLACE
    assert extra in (0, 1), torchrun
    if extra:
        assert torchrun["lastInPlaceRestart"]["fromStep"] == STEPS, torchrun
        assert _resumed(status) == (2, STEPS), status
        print("    known end-of-job abort: one more in-place restart, from the final step")
    else:
        assert torchrun["group"] == 0, torchrun
        assert torchrun["lastInPlaceRestart"]["fromStep"] >= 20
    assert torchrun["announcedInPlaceRestarts"] == IN_PLACE + extra
    messages = sorted(e.message for e in _events(core, namespace, name, "InPlaceRestart"))
    assert len(messages) == IN_PLACE + extra, messages
    assert "torchrun worker group 1" in messages[0] and "torchrun worker group 2" in messages[1]
    ckpts = status["checkpoints"]
    assert ckpts["resumedFrom"]["attempt"] == 2 and ckpts["resumedFrom"]["step"] >= 30
    assert ckpts["lastCommitted"]["step"] == STEPS and ckpts["lastUploaded"]["step"] == STEPS
    assert status["step"] == STEPS
    # Rank 0's step log: each in-place group re-ran from a committed step (a
    # line for every step; a re-run step repeats), and the pod-level attempt
    # (this pod's log) trained every step after its resume exactly once.
    losses = rayjobs.losses(devcluster.state_dir, namespace, rayjobs.head_pod(job))
    resumed = min(losses) - 1
    assert resumed >= 30 and resumed % 5 == 0, losses
    assert sorted(losses) == list(range(resumed + 1, STEPS + 1))
    if not extra:
        assert resumed == ckpts["resumedFrom"]["step"]
    for kind, seconds in killer.mttr:
        print(f"    MTTR {kind}: {seconds:.1f}s")
    print(f"    test body {time.monotonic() - started:.0f}s")
    core.delete_namespace(namespace)
