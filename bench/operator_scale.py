"""Operator at scale: N TrainingJobs applied at once on the devcluster.

Measures, for N jobs of `--nodes` ranks each created as fast as the client
can (one thread pool), with the real operator process already running:

- seconds from a job's creation to all of its rank pods existing (p50, p95,
  max) — the operator's reaction time under a burst, not the pods' start;
- the operator's peak resident memory (from /proc, sampled every 0.5 s);
- API requests per job: the delta of the API server's
  `apiserver_request_total` over the run, minus the bench's own requests,
  divided by N.

The jobs' pods select a node label no node has, so the scheduler leaves them
Pending and nothing runs: only the operator and the API server are measured.
Everything is created in one fresh namespace, deleted at the end.

Usage (devcluster up, operator running, e.g. after `./scripts/demo`):
    python bench/operator_scale.py [--jobs 200] [--nodes 2]
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import pathlib
import re
import statistics
import threading
import time
import uuid
from typing import Any

from kubernetes import client, config, watch

from cairn.api import trainingjob
from cairn.devcluster import cluster, demo, processes

GROUP, VERSION, PLURAL = trainingjob.GROUP, trainingjob.VERSION, trainingjob.PLURAL


LABEL = re.compile(r'(\w+)="([^"]*)"')


def requests_by_kind(api: client.ApiClient) -> collections.Counter[str]:
    """apiserver_request_total summed per "VERB resource[/subresource]" (admin GET /metrics)."""
    counts: collections.Counter[str] = collections.Counter()
    for sample, value in demo.apiserver_request_totals(api).items():
        if not sample.startswith("apiserver_request_total{"):
            continue
        labels = dict(LABEL.findall(sample))
        resource = labels.get("resource", "") or "-"
        if labels.get("subresource"):
            resource += "/" + labels["subresource"]
        counts[f"{labels.get('verb', '?')} {resource}"] += int(value)
    return counts


def job_body(name: str, nodes: int) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "nodes": nodes,
            "image": "cairn-trainer:dev",
            "command": ["python", "-c", "import time; time.sleep(3600)"],
            "template": {"nodeSelector": {"cairn.dev/bench": "no-such-node"}},
            "checkpoint": {"intervalSteps": 100},
        },
    }


def operator_rss_kib(target: cluster.Cluster) -> int:
    tracked = processes.read_pidfile(target.state.pidfile(demo.OPERATOR))
    if tracked is None:
        raise SystemExit("the operator is not running: start it (./scripts/demo) first")
    for line in pathlib.Path(f"/proc/{tracked.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    target = cluster.Cluster.default()
    config.load_kube_config(str(target.state.admin_kubeconfig))
    api = client.ApiClient()
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    demo.install_crd(api)
    if not demo.operator_running(target):
        raise SystemExit("the operator is not running: start it (./scripts/demo) first")
    namespace = f"bench-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    rss_idle = operator_rss_kib(target)
    peak = [rss_idle]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.5):
            peak[0] = max(peak[0], operator_rss_kib(target))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    names = [f"job-{i:04d}" for i in range(args.jobs)]
    created_at: dict[str, float] = {}
    pods_seen: dict[str, set[str]] = {name: set() for name in names}
    complete_at: dict[str, float] = {}
    done = threading.Event()

    def watch_pods() -> None:
        stream = watch.Watch()
        for event in stream.stream(
            core.list_namespaced_pod, namespace, timeout_seconds=int(args.timeout)
        ):
            pod = event["object"]
            job = (pod.metadata.labels or {}).get("cairn.dev/job-name")
            if job in pods_seen and event["type"] == "ADDED":
                pods_seen[job].add(pod.metadata.name)
                if len(pods_seen[job]) >= args.nodes and job not in complete_at:
                    complete_at[job] = time.monotonic()
                    if len(complete_at) == len(names):
                        done.set()
                        stream.stop()

    watcher = threading.Thread(target=watch_pods, daemon=True)
    watcher.start()
    time.sleep(1.0)
    before = requests_by_kind(api)

    def create(name: str) -> None:
        created_at[name] = time.monotonic()
        custom.create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, job_body(name, args.nodes)
        )

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(create, names))
    burst = time.monotonic() - started
    finished = done.wait(args.timeout)
    # Let the last status patches land before counting requests.
    time.sleep(5.0)
    after = requests_by_kind(api)
    stop.set()
    latencies = sorted(complete_at[n] - created_at[n] for n in names if n in complete_at)
    # The bench's own requests: N creates + 2 metrics GETs + one pod watch.
    own = args.jobs + 2 + 1
    print(
        f"jobs: {args.jobs} x {args.nodes} ranks, created in {burst:.1f} s "
        f"({args.jobs / burst:.0f} jobs/s)"
    )
    if not finished:
        print(f"WARNING: only {len(latencies)} of {args.jobs} jobs got all pods in {args.timeout}s")
    if latencies:
        p95 = latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))]
        print(
            f"creation -> all rank pods exist: p50 {statistics.median(latencies):.2f} s, "
            f"p95 {p95:.2f} s, max {latencies[-1]:.2f} s"
        )
        print(
            f"all {len(latencies)} jobs' pods exist {max(complete_at.values()) - started:.1f} s after the first create"
        )
    print(f"operator RSS: {rss_idle / 1024:.0f} MiB before, {peak[0] / 1024:.0f} MiB peak")
    delta = after - before
    print(
        f"API requests per job: {(delta.total() - own) / args.jobs:.1f} "
        "(all clients but this bench), the most frequent:"
    )
    for kind, count in delta.most_common(10):
        print(f"  {count / args.jobs:6.2f}  {kind}")
    started_delete = time.monotonic()
    core.delete_namespace(namespace)
    print(f"namespace {namespace} deleted ({time.monotonic() - started_delete:.1f} s to request)")


if __name__ == "__main__":
    main()
