"""MTTR on the devcluster: SIGKILL of a rank's worker process -> its first training step after.

    python bench/mttr.py [--kills 5]
        [--kinds pod,pod-warm,inplace,warm,warm-mem,lost-gang,lost-replace,
                 ray-pod,ray,ray-mem,ray-lost-gang,ray-lost,ray-force-gang,ray-force]

One job per kind (examples/quickstart.yaml's trainer, 2 nodes x 1 process,
a checkpoint every 5 steps, 80 steps, ``restartPolicy.backoffSeconds: 0`` so
the pod-level figure is the mechanics, not the configured backoff), run one
after the other on the running devcluster and operator:

- ``pod``: ``torchrun``, ``maxInPlaceRestarts: 0`` (today's default): the
  worker's death ends torchrun, the operator restarts every pod (new attempt);
- ``pod-warm``: the same under ``python -m cairn.trainer.launch`` (a new
  pod's fork server imports everything once, then forks its one worker);
- ``inplace``: ``torchrun``, ``maxInPlaceRestarts: 10``: torchrun's agents
  restart the worker group in the same pods, each worker a new interpreter;
- ``warm``: the same under ``python -m cairn.trainer.launch`` (workers forked
  from a server that imported torch, the checkpoint library and, through
  ``--preload=``, the trainer module);
- ``warm-mem``: ``warm`` with the memory tier on (``checkpoint.memory``,
  256 MiB): a restarted group restores from pod memory;
- ``lost-gang`` and ``lost-replace``: rank 1's POD lost instead (deleted
  with grace 0, as when its node is gone: the processes are killed, the pod
  object is gone at once), both under the warm launcher with the memory tier.
  ``lost-gang`` has ``maxInPlaceRestarts: 0``: the operator restarts every
  pod (today's behaviour for a lost pod, and these rows' anchor);
  ``lost-replace`` has ``maxInPlaceRestarts: 10``: the operator replaces only
  that pod in the same attempt, the other pod's agent restarts its worker in
  place, and the new pod's rank restores from its peer's memory replica;
- ``ray-pod``: the Ray runtime, rank 1's pod process SIGKILLed, the gang
  restarted by the operator (bench/ray_recovery_devcluster.py's ``pod`` job):
  the Ray rows' pod-level anchor;
- ``ray``: the Ray runtime in place (its ``inplace`` job, SIGKILL of rank
  1's actor); ``ray-mem``: the same with the memory tier on;
- ``ray-lost-gang`` and ``ray-lost``: the Ray worker pod lost (deleted
  gracefully, as a drain or an eviction through the API does; its ``lost``
  job), memory tier on. ``ray-lost-gang`` has ``ray.maxInPlaceRestarts: 0``:
  every pod restarts (the behaviour before 2026-11-29, and ``ray-lost``'s
  anchor); ``ray-lost`` keeps the budget: the operator replaces only that
  pod, the driver places the group again on the new Ray node, and the new
  rank restores from its peer's memory replica.
- ``ray-force-gang`` and ``ray-force``: the same, the worker pod deleted with
  grace 0 (as when its node is gone: its processes killed, no SIGTERM), so
  the driver learns of the loss only from Ray's node health checks.

The ratio column divides by the same runtime's pod-level median for the same
fault (the faster of ``pod`` and ``pod-warm`` for torchrun's process kills,
``lost-gang`` for its pod losses, ``ray-pod`` for Ray's kills, ``ray-lost-gang`` for its pod losses). Each kind's record keeps the tier its job's
last restore came from (``resumedFrom.tier``).

Each kill: once a step >= 10 (then 5 past the last recovery) is committed,
SIGKILL rank 1's worker process (torchrun's child, or the fork server's child)
and time from the kill to the first line rank 0 appends to its losses file
afterwards (the trainer's own step log: the same pod in place, the new
attempt's rank-0 pod after a pod-level restart), polled every 50 ms. In
place, only lines appended once ``status.torchrun.inPlaceRestarts`` has
grown count (the new group records itself before its restore): rank 0's
old worker can log the step it was finishing just after the kill.
Prints the table (median of ``--kills`` per kind, min, max, ratios to
``pod``, with the load average) and records JSON in bench/results/.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time
import uuid
from typing import Any

from kubernetes import client, config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import ray_recovery_devcluster
import record

from cairn.devcluster import cluster
from tests import demo
from tests.e2e import rayjobs

STEPS = 80
STEP_TIMEOUT = 300.0
"""A kill's deadline to reach the next training step (a hang is a failure)."""
GOAL_SECONDS = 10.0
GOAL_RATIO = 0.1

TORCHRUN_KINDS: dict[str, dict[str, Any]] = {
    "pod": {"command": rayjobs.PLAIN_TORCHRUN, "in_place": 0},
    "pod-warm": {"command": rayjobs.WARM_TORCHRUN, "in_place": 0},
    "inplace": {"command": rayjobs.PLAIN_TORCHRUN, "in_place": 10},
    "warm": {"command": rayjobs.WARM_TORCHRUN, "in_place": 10},
    "warm-mem": {"command": rayjobs.WARM_TORCHRUN, "in_place": 10, "memory": True},
    "lost-gang": {"command": rayjobs.WARM_TORCHRUN, "in_place": 0, "memory": True, "lose": True},
    "lost-replace": {
        "command": rayjobs.WARM_TORCHRUN,
        "in_place": 10,
        "memory": True,
        "lose": True,
    },
}
RAY_KINDS: dict[str, dict[str, Any]] = {
    "ray-pod": {"kill": "pod", "memory": False},
    "ray": {"kill": "inplace", "memory": False},
    "ray-mem": {"kill": "inplace", "memory": True},
    "ray-lost-gang": {"kill": "lost", "memory": True, "in_place": 0},
    "ray-lost": {"kill": "lost", "memory": True},
    "ray-force-gang": {"kill": "lost", "memory": True, "in_place": 0, "force": True},
    "ray-force": {"kill": "lost", "memory": True, "force": True},
}
LABELS = {
    "pod": "torchrun, pod-level restart (maxInPlaceRestarts 0)",
    "pod-warm": "torchrun, pod-level restart under cairn.trainer.launch (maxInPlaceRestarts 0)",
    "inplace": "torchrun, in place",
    "warm": "torchrun, in place + warm (cairn.trainer.launch)",
    "warm-mem": "torchrun, in place + warm + memory tier",
    "lost-gang": "torchrun, pod lost: every pod restarted (maxInPlaceRestarts 0)",
    "lost-replace": "torchrun, pod lost: only it replaced, restore from peer memory",
    "ray-pod": "Ray, pod-level restart (gang)",
    "ray": "Ray, in place",
    "ray-mem": "Ray, in place + memory tier",
    "ray-lost-gang": "Ray, pod lost: every pod restarted (ray.maxInPlaceRestarts 0)",
    "ray-lost": "Ray, pod lost: only it replaced, restore from peer memory",
    "ray-force-gang": "Ray, pod force-deleted: every pod restarted (ray.maxInPlaceRestarts 0)",
    "ray-force": "Ray, pod force-deleted: only it replaced, restore from peer memory",
}


class TorchrunBench:
    """One job of a torchrun kind; its on_poll hook kills and times."""

    def __init__(self, *, target: cluster.Cluster, api: client.ApiClient, kind: str) -> None:
        self.target, self.api, self.kind = target, api, kind
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.namespace = f"bench-mttr-{uuid.uuid4().hex[:6]}"
        bucket = f"bench-mttr-{uuid.uuid4().hex[:6]}"
        demo.prepare_namespace(
            api_client=api, target=target, namespace=self.namespace, bucket=bucket
        )
        self.body = self._manifest(bucket)
        self.samples: list[float] = []
        self.loads: list[float] = []
        self.parents: list[int] = []
        """Each killed worker's parent: the agent (plain torchrun) or the fork server (warm)."""
        self.next_after = 10
        self.final: dict[str, Any] = {}

    def _manifest(self, bucket: str) -> dict[str, Any]:
        shape = TORCHRUN_KINDS[self.kind]
        body = rayjobs.manifest(
            self.target, name=f"mttr-{self.kind}", runtime="torchrun", bucket=bucket, steps=STEPS
        )
        spec = body["spec"]
        spec["command"] = list(shape["command"])
        spec["restartPolicy"] = {"maxRestarts": 10, "backoffSeconds": 0}
        if shape["in_place"]:
            spec["torchrun"] = {"maxInPlaceRestarts": shape["in_place"]}
        if shape.get("memory"):
            spec["checkpoint"]["memory"] = dict(rayjobs.MEMORY_TIER)
        return body

    def poll(self, job: dict[str, Any], kills: int) -> None:
        status = job.get("status") or {}
        if len(self.samples) >= kills or status.get("phase") != "Running":
            return
        if (demo.Row.of(job).committed or 0) < self.next_after:
            return
        name = self.body["metadata"]["name"]
        agent = demo.rank_pid(self.core, namespace=self.namespace, job=name, rank=1)
        worker = None if agent is None else rayjobs.torchrun_worker_pid(agent)
        if agent is None or worker is None:
            return
        head = rayjobs.head_pod(job)
        state = self.target.state.root
        in_place = TORCHRUN_KINDS[self.kind]["in_place"] > 0
        watch = head if in_place else f"{name}-a{status['attempt'] + 1}-n0"
        self.loads.append(os.getloadavg()[0])
        stat = pathlib.Path(f"/proc/{worker}/stat").read_text()
        self.parents.append(int(stat.rsplit(")", 1)[1].split()[1]))
        groups = rayjobs.in_place_restarts(job)
        if TORCHRUN_KINDS[self.kind].get("lose"):
            killed_at = lose_pod(self.core, self.namespace, f"{name}-a{status['attempt']}-n1")
        else:
            killed_at = rayjobs.kill(worker)
        after = 0  # pod-level: the new attempt's rank-0 pod starts its own file
        if in_place:
            # Rank 0's worker can log the step it was finishing right after the
            # kill (seen once as a 0.00 s sample): time to the first line after
            # the new group is in status (recorded before its restore).
            after = rayjobs.lines_once_new_group(
                self.custom,
                state,
                self.namespace,
                name,
                head,
                after=groups,
                deadline=killed_at + STEP_TIMEOUT,
                poll_seconds=0.05,
            )
        stepped = rayjobs.wait_new_step(
            state, self.namespace, watch, after_lines=after, timeout=STEP_TIMEOUT
        )
        self.samples.append(stepped - killed_at)
        print(f"{self.kind}: kill {len(self.samples)}: {stepped - killed_at:.2f}s", flush=True)
        latest = demo.get_job(self.custom, self.namespace, name)
        self.next_after = max(demo.Row.of(latest).committed or 0, self.next_after) + 5

    def run(self, kills: int) -> tuple[list[float], list[float]]:
        self.final = demo.run_job(
            api_client=self.api,
            namespace=self.namespace,
            body=self.body,
            kill_rank_after_commit=None,
            on_row=lambda row: print(f"{self.kind}: {row.line()}", flush=True),
            on_poll=lambda job: self.poll(job, kills),
            timeout=1800,
            poll_seconds=0.5,
        )
        self.core.delete_namespace(self.namespace)
        return self.samples, self.loads


def lose_pod(core: client.CoreV1Api, namespace: str, pod: str) -> float:
    """Delete ``pod`` with grace 0 (its node gone); the monotonic time of the delete."""
    at = time.monotonic()
    core.delete_namespaced_pod(pod, namespace, grace_period_seconds=0)
    return at


def summary(samples: list[float], loads: list[float]) -> dict[str, Any]:
    """Median, min, max of the samples (seconds) and the 1-min load average at the kills. Pure."""
    return {
        "n": len(samples),
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
        "samples": samples,
        "load_1m_at_kills": loads,
    }


def last_tier(job: dict[str, Any]) -> str | None:
    """``status.checkpoints.resumedFrom.tier`` of a finished job. Pure."""
    ckpts = (job.get("status") or {}).get("checkpoints") or {}
    return (ckpts.get("resumedFrom") or {}).get("tier")


def anchors(kind: str) -> tuple[str, ...]:
    """The kinds whose fastest median a kind's ratio divides by: the pod-level
    restart of the same runtime after the same fault (``ray-pod`` for Ray's
    kills, ``ray-lost-gang`` for a lost Ray pod, ``lost-gang`` for a lost
    torchrun pod; for torchrun's process kills ``pod`` and ``pod-warm``, the
    pod-level restart under plain torchrun and under the warm launcher, since
    the launcher's start-up changes help a new pod's first group too). Pure."""
    if kind in RAY_KINDS:
        if RAY_KINDS[kind]["kill"] != "lost":
            return ("ray-pod",)
        return ("ray-force-gang",) if RAY_KINDS[kind].get("force") else ("ray-lost-gang",)
    return ("lost-gang",) if TORCHRUN_KINDS[kind].get("lose") else ("pod", "pod-warm")


def anchor_median(rows: dict[str, dict[str, Any]], kind: str) -> float | None:
    """The fastest median among ``kind``'s anchors that ran (None: none ran). Pure."""
    medians = [rows[a]["median"] for a in anchors(kind) if rows.get(a, {}).get("median")]
    return min(medians) if medians else None


def table(rows: dict[str, dict[str, Any]]) -> str:
    """The Markdown table the docs quote: one row per kind, ratio to the same
    runtime's pod-level median (`anchor`). Pure."""
    lines = [
        "| kind | kills | median s | min s | max s | ratio to pod-level |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for kind, row in rows.items():
        if not row.get("n"):
            lines.append(f"| {LABELS[kind]} | 0 | | | | |")
            continue
        pod = anchor_median(rows, kind)
        ratio = f"{row['median'] / pod:.2f}" if pod else ""
        lines.append(
            f"| {LABELS[kind]} | {row['n']} | {row['median']:.1f} | {row['min']:.1f} "
            f"| {row['max']:.1f} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/mttr.py")
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument(
        "--kinds",
        default="pod,pod-warm,inplace,warm,warm-mem,lost-gang,lost-replace,"
        "ray-pod,ray,ray-mem,ray-lost-gang,ray-lost",
    )
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    unknown = set(kinds) - set(LABELS)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}; known: {sorted(LABELS)}")
    env = record.environment()
    target = cluster.Cluster.default()
    api = config.new_client_from_config(config_file=str(target.state.admin_kubeconfig))
    rows: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        print(f"{kind}: load average {os.getloadavg()}", flush=True)
        if kind in RAY_KINDS:
            shape = RAY_KINDS[kind]
            loads_before = os.getloadavg()[0]
            bench = ray_recovery_devcluster.Bench(
                target,
                api,
                shape["kill"],
                memory=rayjobs.MEMORY_TIER if shape["memory"] else None,
                in_place=shape.get("in_place", 10),
                force=shape.get("force", False),
                steps=(
                    ray_recovery_devcluster.LOST_STEPS
                    if shape["kill"] == "lost"
                    else ray_recovery_devcluster.STEPS
                ),
            )
            samples, loads = bench.run(args.kills), [loads_before]
            final = bench.final
        else:
            torchrun = TorchrunBench(target=target, api=api, kind=kind)
            samples, loads = torchrun.run(args.kills)
            final = torchrun.final
        rows[kind] = summary(samples, loads) if samples else {"n": 0, "samples": []}
        rows[kind]["last_restore_tier"] = last_tier(final)
        if kind not in RAY_KINDS:
            # Warm: one fork server per pod and attempt (fewer parents than kills).
            rows[kind]["killed_worker_parents"] = torchrun.parents
    text = table(rows)
    print(text)
    warm, pod = rows.get("warm", {}).get("median"), anchor_median(rows, "warm")
    goal = None
    if warm is not None and pod:
        goal = {
            "warm_s": warm,
            "ratio": warm / pod,
            "met": warm <= GOAL_SECONDS and warm <= GOAL_RATIO * pod,
        }
        print(f"goal (warm <= {GOAL_SECONDS:.0f}s and <= {GOAL_RATIO}x pod-level): {goal}")
    path = record.write(
        bench="mttr",
        tag=f"{args.kills}kills",
        env=env,
        params={"kills": args.kills, "kinds": kinds, "steps": STEPS, "interval_steps": 5},
        figures={"rows": rows, "table": text, "goal": goal},
    )
    print(f"recorded {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
