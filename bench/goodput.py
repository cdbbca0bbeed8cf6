"""Goodput under a seeded fault schedule (issue 23, item 5): ETTR side by side.

    python bench/goodput.py [--steps 200] [--seed N] [--modes undisturbed,today,fast]
                            [--fast-memory 512Mi] [--fast-warm] [--record]

One 2-node torchrun job of the reference trainer (the torchrun quickstart,
a checkpoint every 5 steps, uploads to the devcluster's S3) per mode, one
after another on the running devcluster and operator:

- ``undisturbed``: no fault; its wall time is the reference;
- ``today``: pod-level restarts (``torchrun.maxInPlaceRestarts: 0``, no
  memory tier, plain ``torchrun``): today's behaviour, kept by the defaults;
- ``fast``: in-place restarts (``maxInPlaceRestarts: 10``), plus the memory
  tier (``checkpoint.memory``) when ``--fast-memory`` names a size, plus the
  warm launcher (``cairn.trainer.launch``) with ``--fast-warm``.

The faulted modes get the same schedule, drawn from ``--seed``: one fault
each time the job has committed another ``steps / (faults + 1)`` steps, in a
seeded order of: SIGKILL of rank 1's worker process (twice), deletion of
rank 1's pod, SIGKILL of the operator (started again at once, as its
Deployment would), and a Kueue-style suspend and resume (``spec.suspend``
true until the job reads Suspended, then false).

ETTR (effective training time ratio) = the undisturbed wall time for the same
steps ÷ the mode's wall time, both from the job's creation to Succeeded.
Every fault's recovery (fault -> the next line of rank 0's step log) is
printed and recorded too. A fault that finds no process or pod to hit is
retried at the next poll; a job that does not finish within its deadline
fails the run (a hang is a failure).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import signal
import statistics
import sys
import time
import uuid
from typing import Any

from kubernetes import client, config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import record  # bench/, next to this script

from cairn.devcluster import cluster, processes
from tests import demo
from tests.e2e import rayjobs

FAULTS = ("rank-kill", "rank-kill", "pod-delete", "operator-kill", "suspend-resume")
JOB_TIMEOUT = 1800.0
RECOVERY_TIMEOUT = 600.0


def schedule(seed: int, steps: int, faults: tuple[str, ...] = FAULTS) -> list[tuple[int, str]]:
    """(committed step to wait for, fault), evenly spaced, in a seeded order."""
    order = list(faults)
    random.Random(seed).shuffle(order)
    gap = steps // (len(order) + 1)
    return [(gap * (i + 1), fault) for i, fault in enumerate(order)]


class Run:
    """One job of one mode, and the on_poll hook that injects its faults."""

    def __init__(
        self, *, target: cluster.Cluster, api: client.ApiClient, mode: str, args: argparse.Namespace
    ) -> None:
        self.target, self.api, self.mode = target, api, mode
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.namespace = f"bench-gp-{uuid.uuid4().hex[:6]}"
        bucket = f"bench-gp-{uuid.uuid4().hex[:6]}"
        demo.prepare_namespace(
            api_client=api, target=target, namespace=self.namespace, bucket=bucket
        )
        body = rayjobs.manifest(
            target, name=f"gp-{mode}", runtime="torchrun", bucket=bucket, steps=args.steps
        )
        spec = body["spec"]
        spec["command"] = list(rayjobs.PLAIN_TORCHRUN)
        spec["restartPolicy"] = {"maxRestarts": 20, "backoffSeconds": 0}
        if mode == "fast":
            spec["torchrun"] = {"maxInPlaceRestarts": 10}
            if args.fast_memory:
                spec["checkpoint"]["memory"] = {"enabled": True, "sizeLimit": args.fast_memory}
            if args.fast_warm:
                spec["command"] = list(rayjobs.WARM_TORCHRUN)
        self.body = body
        self.name = body["metadata"]["name"]
        self.pending = [] if mode == "undisturbed" else schedule(args.seed, args.steps, args.faults)
        self.recoveries: list[dict[str, Any]] = []
        self.suspending = False

    def _lines(self, job: dict[str, Any]) -> tuple[str, int]:
        head = rayjobs.head_pod(job)
        return head, rayjobs.loss_lines(self.target.state.root, self.namespace, head)

    def _inject(self, fault: str, job: dict[str, Any]) -> bool:
        """Strike once; False when there is nothing to strike yet (retry next poll)."""
        if fault == "rank-kill":
            agent = demo.rank_pid(self.core, namespace=self.namespace, job=self.name, rank=1)
            pid = None if agent is None else rayjobs.torchrun_worker_pid(agent)
            if pid is None:
                return False
            os.kill(pid, signal.SIGKILL)
        elif fault == "pod-delete":
            pod = f"{self.name}-a{job['status']['attempt']}-n1"
            self.core.delete_namespaced_pod(pod, self.namespace, grace_period_seconds=0)
        elif fault == "operator-kill":
            tracked = processes.read_pidfile(self.target.state.pidfile(demo.OPERATOR))
            if tracked is None:
                return False
            os.kill(tracked.pid, signal.SIGKILL)
            while processes.is_alive(tracked):
                time.sleep(0.05)
            demo.start_operator(self.target)
        else:  # suspend-resume: suspend now, resume once Suspended (poll())
            self._patch_suspend(True)
            self.suspending = True
        return True

    def _patch_suspend(self, value: bool) -> None:
        demo.retrying(
            lambda: self.custom.patch_namespaced_custom_object(
                demo.GROUP,
                demo.VERSION,
                self.namespace,
                demo.PLURAL,
                self.name,
                {"spec": {"suspend": value}},
            )
        )

    def poll(self, job: dict[str, Any]) -> None:
        status = job.get("status") or {}
        if self.suspending:
            self._resume_once_suspended(job)
            return
        committed = demo.Row.of(job).committed or 0
        if not self.pending or status.get("phase") != "Running" or committed < self.pending[0][0]:
            return
        fault = self.pending[0][1]
        head, before = self._lines(job)
        struck = time.monotonic()
        if not self._inject(fault, job):
            return
        self.pending.pop(0)
        self._recover(fault=fault, struck=struck, head=head, before=before)

    def _recover(self, *, fault: str, struck: float, head: str, before: int) -> None:
        """Wait for the next training step after the fault (a step log line)."""
        deadline = struck + RECOVERY_TIMEOUT
        while time.monotonic() < deadline:
            job = demo.get_job(self.custom, self.namespace, self.name)
            self._resume_once_suspended(job)
            status = job.get("status") or {}
            if status.get("phase") == "Running" and status.get("attempt"):
                now_head = rayjobs.head_pod(job)
                lines = rayjobs.loss_lines(self.target.state.root, self.namespace, now_head)
                # A suspend's final checkpoint trains on to a step boundary:
                # it is back only when the resumed attempt trains.
                same = now_head == head
                if lines > (before if same else 0) and not (same and fault == "suspend-resume"):
                    seconds = time.monotonic() - struck
                    self.recoveries.append({"fault": fault, "seconds": round(seconds, 2)})
                    print(f"{self.mode}: {fault}: back to training in {seconds:.1f}s", flush=True)
                    return
            if status.get("phase") in ("Succeeded", "Failed"):
                return
            time.sleep(0.1)
        raise RuntimeError(f"{self.mode}: no training step {RECOVERY_TIMEOUT:.0f}s after {fault}")

    def _resume_once_suspended(self, job: dict[str, Any]) -> None:
        if self.suspending and (job.get("status") or {}).get("phase") == "Suspended":
            self._patch_suspend(False)
            self.suspending = False

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        job = demo.run_job(
            api_client=self.api,
            namespace=self.namespace,
            body=self.body,
            kill_rank_after_commit=None,
            on_row=lambda row: print(f"{self.mode}: {row.line()}", flush=True),
            on_poll=self.poll,
            timeout=JOB_TIMEOUT,
            poll_seconds=0.5,
        )
        wall = time.monotonic() - started
        status = job["status"]
        self.core.delete_namespace(self.namespace)
        if status["phase"] != "Succeeded" or self.pending:
            why = [
                (c.get("type"), c.get("reason"), c.get("message"))
                for c in status.get("conditions", [])
            ]
            raise RuntimeError(f"{self.mode}: {status['phase']}, faults left {self.pending}: {why}")
        return {
            "wall_seconds": round(wall, 1),
            "attempt": status["attempt"],
            "restarts": status.get("restarts", 0),
            "in_place_restarts": rayjobs.in_place_restarts(job),
            "resumed_from": (status.get("checkpoints") or {}).get("resumedFrom"),
            "recoveries": self.recoveries,
            "median_recovery_seconds": (
                statistics.median(r["seconds"] for r in self.recoveries)
                if self.recoveries
                else None
            ),
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/goodput.py")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--modes", default="undisturbed,today,fast")
    parser.add_argument("--fast-memory", default="", help="checkpoint.memory.sizeLimit, or none")
    parser.add_argument(
        "--fast-warm", action="store_true", help="the warm launcher instead of torchrun"
    )
    parser.add_argument("--faults", default=",".join(FAULTS), help="the faults to schedule")
    parser.add_argument("--record", action="store_true", help="write bench/results/goodput-*")
    args = parser.parse_args(argv)
    args.faults = tuple(args.faults.split(","))
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2**30)
    env = record.environment()
    target = cluster.Cluster.default()
    api = config.new_client_from_config(config_file=str(target.state.admin_kubeconfig))
    print(f"seed {args.seed}: schedule {schedule(args.seed, args.steps, args.faults)}", flush=True)
    results: dict[str, Any] = {}
    for mode in args.modes.split(","):
        results[mode] = Run(target=target, api=api, mode=mode, args=args).run()
    rows = {}
    if "undisturbed" in results:
        base = results["undisturbed"]["wall_seconds"]
        for res in results.values():
            res["ettr"] = round(base / res["wall_seconds"], 3)
        rows = {mode: res["ettr"] for mode, res in results.items()}
    print(f"{'mode':<12} {'wall s':>8} {'ETTR':>6} {'median recovery s':>18}")
    for mode, res in results.items():
        med = res["median_recovery_seconds"]
        print(
            f"{mode:<12} {res['wall_seconds']:>8.1f} {res.get('ettr', float('nan')):>6.3f} "
            f"{'-' if med is None else f'{med:.1f}':>18}"
        )
    if args.record:
        params = {k: v for k, v in vars(args).items() if k != "record"}
        params["schedule"] = schedule(args.seed, args.steps, args.faults)
        path = record.write(
            bench="goodput",
            tag=str(args.steps),
            env=env,
            params=params,
            figures={"modes": results, "ettr": rows},
        )
        print(f"record: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
