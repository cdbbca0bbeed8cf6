"""Ray runtime on the devcluster: recovery time, SIGKILL → next training step.

    python bench/ray_recovery_devcluster.py [--kills 3] [--out result.json]

Two jobs of examples/quickstart-ray.yaml (80 steps, a checkpoint every 5,
``restartPolicy.backoffSeconds: 0`` so the pod-level number is the mechanics,
not the configured backoff) on the running devcluster and operator:

- in place: once a step >= 10 is committed, SIGKILL rank 1's actor process
  (its PID from the driver's ``group N started`` log line), ``--kills`` times,
  each after the new group committed a newer step;
- pod level: SIGKILL the worker pod's process (the container's PID), the
  same number of times, each after the new attempt committed a newer step;
- lost: delete the worker pod (graceful, as a drain or an eviction through
  the API does); with an in-place budget the operator replaces it and the
  driver places the group again (same attempt), without one the gang
  restarts (``in_place=0``); with ``force`` deleted with grace 0, as when its
  node is gone.

Recovery = from the kill to the first line rank 0 appends to its losses file
afterwards (the same head pod's file in place, counted once the new group is
in ``status.ray``, after a killed actor as after a loss; the new head pod's file after a gang
restart), polled every 50 ms. Prints median, min and max per kind and
writes the samples as JSON.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
import uuid
from typing import Any

from kubernetes import client, config

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from cairn.devcluster import cluster
from tests import demo
from tests.e2e import rayjobs

STEPS = 80
LOST_STEPS = 300
"""A lost pod's job: its worker trains on through the 5 s lone-loss window
(~25 steps) before each loss shows, so five losses need more steps."""
STEP_TIMEOUT = 300.0


class Bench:
    def __init__(
        self,
        target: cluster.Cluster,
        api: client.ApiClient,
        kind: str,
        *,
        memory: dict[str, Any] | None = None,
        in_place: int = 10,
        steps: int = STEPS,
        force: bool = False,
    ) -> None:
        self.target = target
        self.kind = kind
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.api = api
        self.namespace = f"bench-ray-{uuid.uuid4().hex[:6]}"
        bucket = f"bench-ray-{uuid.uuid4().hex[:6]}"
        demo.prepare_namespace(
            api_client=api, target=target, namespace=self.namespace, bucket=bucket
        )
        self.body = rayjobs.manifest(
            target, name=f"rec-{kind}", runtime="ray", bucket=bucket, steps=steps
        )
        self.body["spec"]["restartPolicy"] = {"maxRestarts": 10, "backoffSeconds": 0}
        self.body["spec"]["ray"]["maxInPlaceRestarts"] = in_place
        if memory is not None:  # the memory tier (`checkpoint.memory`)
            self.body["spec"]["checkpoint"]["memory"] = dict(memory)
        self.force = force
        """A lost pod is deleted with grace 0 (its node gone) rather than gracefully."""
        self.samples: list[float] = []
        self.final: dict[str, Any] = {}
        self.next_after = 10

    def job(self) -> dict[str, Any]:
        return demo.get_job(self.custom, self.namespace, self.body["metadata"]["name"])

    def poll(self, job: dict[str, Any], kills: int) -> None:
        status = job.get("status") or {}
        if len(self.samples) >= kills or status.get("phase") != "Running":
            return
        if (demo.Row.of(job).committed or 0) < self.next_after:
            return
        head = rayjobs.head_pod(job)
        state = self.target.state.root
        if self.kind == "inplace":
            groups = rayjobs.group_pids(self.core, self.namespace, head)
            if not groups:
                return
            name = self.body["metadata"]["name"]
            restarts = rayjobs.in_place_restarts(job, runtime="ray")
            killed_at = rayjobs.kill(groups[max(groups)][1])
            # Rank 0's old actor can log the step it was finishing right after
            # the kill (seen once as a 0.05 s sample): time to the first line
            # after the driver recorded the new group (before the group starts).
            after = rayjobs.lines_once_new_group(
                self.custom,
                state,
                self.namespace,
                name,
                head,
                after=restarts,
                deadline=killed_at + STEP_TIMEOUT,
                poll_seconds=0.05,
                runtime="ray",
            )
            watch = head
        elif self.kind == "lost":
            name = self.body["metadata"]["name"]
            pod = f"{name}-a{status['attempt']}-n1"
            if pod not in rayjobs.pod_uids(self.core, self.namespace, name):
                return
            restarts = rayjobs.in_place_restarts(job, runtime="ray")
            killed_at = time.monotonic()
            grace = {"grace_period_seconds": 0} if self.force else {}
            self.core.delete_namespaced_pod(pod, self.namespace, **grace)
            if self.body["spec"]["ray"]["maxInPlaceRestarts"] > 0:
                after = rayjobs.lines_once_new_group(
                    self.custom,
                    state,
                    self.namespace,
                    name,
                    head,
                    after=restarts,
                    deadline=killed_at + STEP_TIMEOUT,
                    poll_seconds=0.05,
                    runtime="ray",
                )
                watch = head
            else:
                watch, after = f"{name}-a{status['attempt'] + 1}-n0", 0
        else:
            name = self.body["metadata"]["name"]
            pid = demo.rank_pid(self.core, namespace=self.namespace, job=name, rank=1)
            if pid is None:
                return
            killed_at = rayjobs.kill(pid)
            watch = f"{name}-a{status['attempt'] + 1}-n0"
            after = 0
        stepped = rayjobs.wait_new_step(
            state, self.namespace, watch, after_lines=after, timeout=STEP_TIMEOUT
        )
        self.samples.append(stepped - killed_at)
        print(f"{self.kind}: kill {len(self.samples)}: {stepped - killed_at:.2f}s", flush=True)
        self.next_after = max(demo.Row.of(self.job()).committed or 0, self.next_after) + 5

    def run(self, kills: int) -> list[float]:
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
        return self.samples


def _summary(samples: list[float]) -> dict[str, float]:
    return {
        "n": len(samples),
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/ray_recovery_devcluster.py")
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--kinds", default="inplace,pod")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    target = cluster.Cluster.default()
    api = config.new_client_from_config(config_file=str(target.state.admin_kubeconfig))
    result: dict[str, Any] = {}
    for kind in args.kinds.split(","):
        samples = Bench(target, api, kind).run(args.kills)
        result[kind] = {"samples": samples, **(_summary(samples) if samples else {})}
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
