"""The operator SIGKILLed at random moments converges without duplicates.

Covers: a job whose rank 1 keeps failing (exit 3 after ~1 s) cycles through
Starting → Running → Restarting → Starting… while the operator process is
SIGKILLed (PID from its pidfile) KILLS times at random moments and started
again; then a flag file makes the next attempt succeed. Watches record every
version of the job and every pod event, and show:
- no duplicate pods: every pod name was created once (one uid), each attempt
  has exactly one pod per rank, and no pod of attempt N+1 was created while a
  pod of an older attempt was still live (no overlapping gangs);
- no double-counted restarts: in every recorded status `restarts` is
  attempt-1 (attempt while Restarting), never decreases, and equals
  restartsCountTowardsMax; at the end the job Succeeded with
  restarts == attempt - 1;
- at most one AttemptStarted / RankFailed event per attempt.
"""

import collections
import os
import pathlib
import random
import re
import signal
import time
from typing import Any

import pytest

from cairn.devcluster import processes
from tests import demo
from tests.conftest import OperatorProcess
from tests.integration.devcluster import kube_helpers as kh
from tests.integration.operator.conftest import JobWatch, Kube, Recorder, job_body

pytestmark = pytest.mark.cluster

KILLS = 20
FLAKY = """
import os, pathlib, sys, time
if pathlib.Path(os.environ['DONE_FLAG']).exists():
    time.sleep(1)
    sys.exit(0)
if os.environ['CAIRN_NODE_RANK'] == '1':
    time.sleep(1)
    sys.exit(3)
time.sleep(600)
"""
TERMINAL = ("Succeeded", "Failed")


def _kill_operator(target: Any) -> None:
    """SIGKILL the tracked operator process and wait until it is gone."""
    tracked = processes.read_pidfile(target.state.pidfile(demo.OPERATOR))
    if tracked is None:
        return
    if processes.is_alive(tracked):
        os.kill(tracked.pid, signal.SIGKILL)
        kh.wait_for(lambda: not processes.is_alive(tracked), timeout=10, what="operator dead")
    processes.stop(tracked, grace_seconds=0)  # reaps it when it is our own child


def _attempt_of(pod: dict[str, Any]) -> int:
    return int(pod["metadata"]["labels"]["cairn.dev/attempt"])


def _check_pods(events: list[tuple[str, dict[str, Any]]], *, nodes: int) -> dict[int, set[str]]:
    """Replay the pod events in order; fail on a duplicate or overlapping gang."""
    uids: dict[str, set[str]] = collections.defaultdict(set)
    live: dict[str, dict[str, Any]] = {}
    by_attempt: dict[int, set[str]] = collections.defaultdict(set)
    for kind, pod in events:
        name = pod["metadata"]["name"]
        uids[name].add(pod["metadata"]["uid"])
        attempt = _attempt_of(pod)
        if kind == "ADDED":
            older = [
                other
                for other, seen in live.items()
                if _attempt_of(seen) < attempt
                and (seen.get("status") or {}).get("phase") not in TERMINAL
            ]
            assert not older, f"{name} created while {older} of an older attempt were live"
            by_attempt[attempt].add(name)
        if kind == "DELETED":
            live.pop(name, None)
        else:
            live[name] = pod
    duplicated = {name: ids for name, ids in uids.items() if len(ids) > 1}
    assert not duplicated, f"pods created twice: {duplicated}"
    for attempt, names in by_attempt.items():
        assert len(names) == nodes, (attempt, sorted(names))
    return by_attempt


def _check_statuses(statuses: list[dict[str, Any]]) -> None:
    previous = (0, 0)
    for status in statuses:
        if "attempt" not in status:
            continue
        attempt, restarts = status["attempt"], status["restarts"]
        expected = attempt if status["phase"] == "Restarting" else attempt - 1
        assert restarts == expected, status
        assert status["restartsCountTowardsMax"] == restarts, status
        assert (attempt, restarts) >= previous, (previous, status)
        if status["phase"] == "Restarting":
            assert status["lastFailure"]["attempt"] == attempt, status
            assert status["lastFailure"]["counted"] is True
        previous = (attempt, restarts)


def test_operator_killed_mid_lifecycle_converges(
    kube: Kube, operator: OperatorProcess, tmp_path: pathlib.Path
) -> None:
    target = operator.target
    seed = random.randrange(1 << 30)
    chance = random.Random(seed)
    flag = tmp_path / "done"
    body = job_body(
        "kill",
        script=FLAKY,
        env=[{"name": "DONE_FLAG", "value": str(flag)}],
        restartPolicy={"maxRestarts": 1000, "backoffSeconds": 0, "maxBackoffSeconds": 0},
    )
    pods_rv = kube.core.list_namespaced_pod(kube.namespace).metadata.resource_version
    pod_watch = Recorder(
        kube,
        kube.core.list_namespaced_pod,
        kube.namespace,
        label_selector="cairn.dev/job-name=kill",
        resource_version=pods_rv,
    )
    created = kube.create(body)
    job_watch = JobWatch(kube, "kill", resource_version=created["metadata"]["resourceVersion"])
    killed_in: list[str] = []
    try:
        version = created["metadata"]["resourceVersion"]
        for _ in range(KILLS):
            # Once the (restarted) operator has acted on the job, kill it at a random moment.
            seen = version
            kh.wait_for(
                lambda: kube.job("kill")["metadata"]["resourceVersion"] != seen,  # noqa: B023
                timeout=60,
                what="the operator acting on the job",
            )
            # Half the kills land right after a change, likely mid-apply (status
            # patched, deletes or creates still to come); half anywhere later.
            time.sleep(
                chance.uniform(0.0, 0.2) if chance.random() < 0.5 else chance.uniform(0.2, 1.5)
            )
            job = kube.job("kill")
            version = job["metadata"]["resourceVersion"]
            killed_in.append((job.get("status") or {}).get("phase", "-"))
            _kill_operator(target)
            time.sleep(chance.uniform(0.0, 0.5))
            demo.start_operator(target)
        flag.write_text("done")
        status = kube.wait_phase("kill", "Succeeded", timeout=120)
    finally:
        operator.ensure_running()
        job_watch.stop()
        pod_watch.stop()

    assert status["restarts"] == status["attempt"] - 1, (seed, status)
    assert status["restartsCountTowardsMax"] == status["restarts"]
    assert status["attempt"] >= 2, "the job never restarted"
    _check_statuses(job_watch.statuses())
    by_attempt = _check_pods(pod_watch.recorded(), nodes=2)
    assert sorted(by_attempt) == list(range(1, status["attempt"] + 1)), seed

    events = kube.events("kill")
    for reason in ("AttemptStarted", "RankFailed"):
        attempts = [
            int(m.group(1))
            for e in events
            if e.reason == reason and (m := re.match(r"attempt (\d+):", e.message))
        ]
        repeated = [a for a, n in collections.Counter(attempts).items() if n > 1]
        assert not repeated, f"{reason} announced twice for attempts {repeated} (seed {seed})"
    phases = dict(collections.Counter(killed_in))
    print(f"seed {seed}: {KILLS} kills over {status['attempt']} attempts, in phases {phases}")
