"""Operator at scale: N TrainingJobs, then N Indexed Jobs, on the devcluster.

Measures, for N jobs of `--nodes` ranks each created as fast as the client
can (one thread pool), with the real operator process already running, and
then the same for N `batch/v1` Indexed Jobs (completions = parallelism =
ranks, the same pod template) handled by kube-controller-manager's Job
controller on the same cluster, one after the other:

- seconds from a job's creation to all of its pods existing (p50, p95, max)
  for each, and Cairn's divided by the Job controller's (the anchor: the
  same machine, API server and moment);
- the operator's peak resident memory and CPU seconds (from /proc);
- API requests per job by verb and resource: the delta of the API server's
  `apiserver_request_total` over each phase, divided by N (every client,
  the bench's own creates included);
- status writes per job per minute over an idle window after the burst,
  with `--writers` of the jobs given a stand-in writer (the trainer's own
  `StatusReporter` with the default budget, its step moving every second,
  as rank 0 reports it), split into the writers' patches and the rest.

The pods select a node label no node has, so the scheduler leaves them
Pending and nothing runs: only the controllers and the API server are
measured. Everything is created in one fresh namespace, deleted at the end.

Usage (devcluster up, operator running, e.g. after `./scripts/demo`):
    python -m bench.operator_scale [--jobs 200] [--nodes 2] [--window 60] [--writers 200]
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import os
import pathlib
import re
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from kubernetes import client, config, watch

from cairn.api import trainingjob
from cairn.devcluster import cluster, processes
from cairn.trainer import status_reporter
from tests import demo

GROUP, VERSION, PLURAL = trainingjob.GROUP, trainingjob.VERSION, trainingjob.PLURAL
COMMAND = ["python", "-c", "import time; time.sleep(3600)"]
NODE_SELECTOR = {"cairn.dev/bench": "no-such-node"}
CAIRN_LABEL = "cairn.dev/job-name"
BATCH_LABEL = "batch.kubernetes.io/job-name"
STATUS_PATCH = "PATCH trainingjobs/status"

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


def training_job(name: str, nodes: int) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {
            "nodes": nodes,
            "image": "cairn-trainer:dev",
            "command": COMMAND,
            "template": {"nodeSelector": NODE_SELECTOR},
            "checkpoint": {"intervalSteps": 100},
        },
    }


def indexed_job(name: str, nodes: int) -> dict[str, Any]:
    """The Job controller's equivalent: one pod per rank, the same container."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "completionMode": "Indexed",
            "completions": nodes,
            "parallelism": nodes,
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "nodeSelector": NODE_SELECTOR,
                    "containers": [
                        {"name": "trainer", "image": "cairn-trainer:dev", "command": COMMAND}
                    ],
                }
            },
        },
    }


def operator_pid(target: cluster.Cluster) -> int:
    tracked = processes.read_pidfile(target.state.pidfile(demo.OPERATOR))
    if tracked is None:
        raise SystemExit("the operator is not running: start it (./scripts/demo) first")
    return tracked.pid


def rss_kib(pid: int) -> int:
    """The process's resident memory; 0 once it is gone (someone restarted the operator)."""
    path = pathlib.Path(f"/proc/{pid}/status")
    if not path.exists():
        return 0
    for line in path.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU of the process (fields 14 and 15 of /proc/PID/stat)."""
    path = pathlib.Path(f"/proc/{pid}/stat")
    if not path.exists():
        return float("nan")
    fields = path.read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class PeakRss(threading.Thread):
    """The operator's peak RSS, sampled every 0.5 s until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak = self.idle = rss_kib(pid)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.5):
            self.peak = max(self.peak, rss_kib(self.pid))


class PodsExist(threading.Thread):
    """When each job (by `label`) first has `ranks` pods, from a namespace pod watch."""

    def __init__(
        self, core: client.CoreV1Api, namespace: str, *, label: str, names: list[str], ranks: int
    ) -> None:
        super().__init__(daemon=True)
        self.core, self.namespace, self.label, self.ranks = core, namespace, label, ranks
        self.seen: dict[str, set[str]] = {name: set() for name in names}
        self.complete_at: dict[str, float] = {}
        self.done = threading.Event()
        self.stream = watch.Watch()

    def run(self) -> None:
        for event in self.stream.stream(
            self.core.list_namespaced_pod, self.namespace, label_selector=self.label
        ):
            pod = event["object"]
            job = (pod.metadata.labels or {}).get(self.label)
            if job not in self.seen or event["type"] != "ADDED":
                continue
            self.seen[job].add(pod.metadata.name)
            if len(self.seen[job]) >= self.ranks and job not in self.complete_at:
                self.complete_at[job] = time.monotonic()
                if len(self.complete_at) == len(self.seen):
                    self.done.set()
                    self.stream.stop()
                    return


@dataclasses.dataclass(frozen=True, kw_only=True)
class Burst:
    """One controller's reaction to N creates."""

    latencies: list[float]
    create_seconds: float
    all_seconds: float
    operator_cpu: float
    requests: collections.Counter[str]

    def quantile(self, q: float) -> float:
        return self.latencies[min(len(self.latencies) - 1, int(q * len(self.latencies)))]


def burst(
    *,
    api: client.ApiClient,
    namespace: str,
    label: str,
    names: list[str],
    ranks: int,
    create: Callable[[str], Any],
    pid: int,
    timeout: float,
) -> Burst:
    """Create every job from 16 threads; wait until all have their pods (bounded)."""
    watcher = PodsExist(client.CoreV1Api(api), namespace, label=label, names=names, ranks=ranks)
    watcher.start()
    time.sleep(1.0)  # the watch is open before the first create
    created_at: dict[str, float] = {}

    def one(name: str) -> None:
        created_at[name] = time.monotonic()
        create(name)

    before, cpu_before = requests_by_kind(api), cpu_seconds(pid)
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(one, names))
    created = time.monotonic() - started
    if not watcher.done.wait(timeout):
        print(f"WARNING: {len(watcher.complete_at)} of {len(names)} got all pods in {timeout} s")
    time.sleep(5.0)  # let the last status patches and events land before counting
    watcher.stream.stop()
    done = watcher.complete_at
    return Burst(
        latencies=sorted(done[n] - created_at[n] for n in names if n in done),
        create_seconds=created,
        all_seconds=(max(done.values()) - started) if done else float("nan"),
        operator_cpu=cpu_seconds(pid) - cpu_before,
        requests=requests_by_kind(api) - before,
    )


def changed_fields(before: dict[str, Any], after: dict[str, Any]) -> str:
    """Pure: which parts of a job one write changed ("status.step", "metadata.annotations", ...)."""
    parts = []
    for section in ("metadata", "spec", "status"):
        old, new = before.get(section) or {}, after.get(section) or {}
        if section == "spec":
            parts += ["spec"] if old != new else []
            continue
        ignored = {"resourceVersion", "managedFields", "generation"}
        keys = sorted((set(old) | set(new)) - ignored)
        parts += [f"{section}.{k}" for k in keys if old.get(k) != new.get(k)]
        if section == "status" and old.get("conditions") != new.get("conditions"):
            which = f"status.conditions({_changed_conditions(old, new)})"
            parts = [which if part == "status.conditions" else part for part in parts]
    return "+".join(parts) or "-"


def _changed_conditions(old: dict[str, Any], new: dict[str, Any]) -> str:
    """Pure: the types of the conditions a write changed, e.g. "Ready:reason,message"."""
    before = {c["type"]: c for c in old.get("conditions") or []}
    out = []
    for cond in new.get("conditions") or []:
        prev = before.get(cond["type"]) or {}
        fields = [k for k in ("status", "reason", "message") if prev.get(k) != cond.get(k)]
        if fields:
            out.append(f"{cond['type']}:{','.join(fields)}")
    return " ".join(out)


class Modified(threading.Thread):
    """Every write that changed one of the namespace's TrainingJobs, by the fields it changed.

    Counted in the bench's own namespace from a watch (resumed where it broke),
    so other engineers' jobs on the shared cluster do not count (the API
    server's counters are global)."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        super().__init__(daemon=True)
        self.custom = client.CustomObjectsApi(api)
        self.namespace = namespace
        listed = self.custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
        self.resource_version = listed["metadata"]["resourceVersion"]
        self.last = {item["metadata"]["name"]: item for item in listed["items"]}
        self.changes: collections.Counter[str] = collections.Counter()
        self.stopped = threading.Event()
        self.stream = watch.Watch()

    @property
    def count(self) -> int:
        return self.changes.total()

    def stop(self) -> None:
        self.stopped.set()
        self.stream.stop()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self._follow()
            except Exception as exc:  # a watch the server ended: resume from the last version
                print(f"  (job watch resumed after {type(exc).__name__})")

    def _follow(self) -> None:
        for event in self.stream.stream(
            self.custom.list_namespaced_custom_object,
            GROUP,
            VERSION,
            self.namespace,
            PLURAL,
            resource_version=self.resource_version,
            timeout_seconds=300,
        ):
            job = event["object"]
            self.resource_version = job["metadata"]["resourceVersion"]
            name = job["metadata"]["name"]
            if event["type"] == "MODIFIED" and name in self.last:
                self.changes[changed_fields(self.last[name], job)] += 1
            self.last[name] = job


@dataclasses.dataclass(frozen=True, kw_only=True)
class Window:
    seconds: float
    status_patches: int
    job_writes: int
    job_changes: collections.Counter[str]
    writer_patches: int
    writers: int
    operator_cpu: float


def idle_window(
    *, api: client.ApiClient, namespace: str, names: list[str], seconds: float, pid: int
) -> Window:
    """Stand-in writers on `names` for `seconds`; the status PATCHes that reached the server."""
    reporters = [
        status_reporter.StatusReporter(
            patch=status_reporter.kubernetes_patcher(api_client=api, namespace=namespace, name=n)
        )
        for n in names
    ]
    modified = Modified(api, namespace)
    modified.start()
    before, cpu_before = requests_by_kind(api), cpu_seconds(pid)
    started = time.monotonic()
    step = 0
    while time.monotonic() - started < seconds:
        step += 1
        for reporter in reporters:
            reporter.update(step=step, checkpoints=None)
        time.sleep(1.0)
    after, cpu_after = requests_by_kind(api), cpu_seconds(pid)
    modified.stop()
    sent = sum(r.stats.patches_sent + r.stats.patch_failures for r in reporters)
    for reporter in reporters:
        reporter.close(timeout_seconds=0.0)
    return Window(
        seconds=time.monotonic() - started,
        status_patches=(after - before)[STATUS_PATCH],
        job_writes=modified.count,
        job_changes=modified.changes,
        writer_patches=sent,
        writers=len(names),
        operator_cpu=cpu_after - cpu_before,
    )


def _print_burst(title: str, result: Burst, jobs: int) -> None:
    lat = result.latencies
    print(f"{title}: {jobs} created in {result.create_seconds:.1f} s")
    if lat:
        print(
            f"  creation -> all pods exist: p50 {statistics.median(lat):.2f} s, "
            f"p95 {result.quantile(0.95):.2f} s, max {lat[-1]:.2f} s; all after "
            f"{result.all_seconds:.1f} s"
        )
    print(
        f"  operator CPU {result.operator_cpu:.1f} s; API requests per job "
        f"{result.requests.total() / jobs:.1f} (all clients), the most frequent:"
    )
    for kind, count in result.requests.most_common(12):
        print(f"    {count / jobs:6.2f}  {kind}")


def report(cairn: Burst, batch: Burst, window: Window | None, rss: PeakRss, jobs: int) -> None:
    _print_burst("TrainingJobs (Cairn operator)", cairn, jobs)
    _print_burst("Indexed Jobs (Job controller)", batch, jobs)
    if cairn.latencies and batch.latencies:
        print(
            "Cairn / Job controller: "
            f"p50 {statistics.median(cairn.latencies) / statistics.median(batch.latencies):.2f}, "
            f"p95 {cairn.quantile(0.95) / batch.quantile(0.95):.2f}, "
            f"max {cairn.latencies[-1] / batch.latencies[-1]:.2f}"
        )
    print(f"operator RSS: {rss.idle / 1024:.0f} MiB before, {rss.peak / 1024:.0f} MiB peak")
    if window is not None:
        minutes = window.seconds / 60
        others = max(0, window.job_writes - window.writer_patches)
        print(
            f"idle window of {window.seconds:.0f} s, {window.writers} stand-in writers "
            f"(a step a second, default budget): writer patches "
            f"{window.writer_patches / window.writers / minutes:.2f} per writing job per "
            f"minute; writes to the bench's jobs "
            f"{window.job_writes / jobs / minutes:.2f} per job per minute, of which not the "
            f"writers' {others / jobs / minutes:.2f}; status PATCHes on the whole server "
            f"(every engineer's jobs) {window.status_patches / minutes:.0f} per minute; "
            f"operator CPU {window.operator_cpu:.1f} s"
        )
        print("  writes to the bench's jobs by the fields they changed, per job per minute:")
        for fields, count in window.job_changes.most_common(8):
            print(f"    {count / jobs / minutes:6.2f}  {fields}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--window", type=float, default=60, help="idle window, s (0: none)")
    parser.add_argument("--writers", type=int, default=200, help="stand-in writers in it")
    args = parser.parse_args()
    target = cluster.Cluster.default()
    config.load_kube_config(str(target.state.admin_kubeconfig))
    api = client.ApiClient(client.Configuration.get_default_copy())
    api.configuration.connection_pool_maxsize = 32
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    batch_api = client.BatchV1Api(api)
    demo.install_crd(api)
    pid = operator_pid(target)
    namespace = f"bench-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    rss = PeakRss(pid)
    rss.start()
    try:
        names = [f"job-{i:04d}" for i in range(args.jobs)]
        common = {"api": api, "namespace": namespace, "ranks": args.nodes, "pid": pid}
        cairn = burst(
            label=CAIRN_LABEL,
            names=names,
            create=lambda n: custom.create_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, training_job(n, args.nodes)
            ),
            timeout=args.timeout,
            **common,
        )
        window = None
        if args.window > 0 and args.writers > 0:
            window = idle_window(
                api=api,
                namespace=namespace,
                names=names[: args.writers],
                seconds=args.window,
                pid=pid,
            )
        batch_names = [f"batch-{i:04d}" for i in range(args.jobs)]
        batch = burst(
            label=BATCH_LABEL,
            names=batch_names,
            create=lambda n: batch_api.create_namespaced_job(namespace, indexed_job(n, args.nodes)),
            timeout=args.timeout,
            **common,
        )
        rss.stop.set()
        report(cairn, batch, window, rss, args.jobs)
        if not pathlib.Path(f"/proc/{pid}").exists():
            print(f"WARNING: operator pid {pid} exited during the run: the numbers are not valid")
    finally:
        started = time.monotonic()
        core.delete_namespace(namespace)
        print(f"namespace {namespace} deleted ({time.monotonic() - started:.1f} s to request)")


if __name__ == "__main__":
    main()
