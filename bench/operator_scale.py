"""Operator at scale: N TrainingJobs, then N Indexed Jobs, on the devcluster.

Measures, for N jobs of `--nodes` ranks each created as fast as the client
can (one thread pool), with the real operator process already running, and
then the same for N `batch/v1` Indexed Jobs (completions = parallelism =
ranks, the same pod template) handled by kube-controller-manager's Job
controller on the same cluster, one after the other:

- seconds from a job's creation to all of its pods existing (p50, p95, max)
  for each, and Cairn's divided by the Job controller's (the anchor: the
  same machine, API server and moment; KCM on its default client rate
  limit, which binds: `bench/scale_anchor.py` is the fair anchor);
- the operator's peak resident memory and CPU seconds (from /proc);
- API requests per job by verb and resource: the delta of the API server's
  `apiserver_request_total` over each phase, divided by N (every client,
  the bench's own creates included);
- status writes per job per minute over an idle window after the burst,
  with `--writers` of the jobs given a stand-in writer (the trainer's own
  `StatusReporter` with the default budget, its step moving every second,
  as rank 0 reports it), split into the writers' patches and the rest;
- cold start (`--own-cluster`): the operator is stopped and started again
  with the N TrainingJobs in place; the seconds until it has observed every
  job (its `cairn_trainingjobs` gauge counts N and it reconciled N times)
  and until the steady state (observed, and no write to any of the jobs for
  `--quiet` seconds), the writes to the jobs and the API requests by kind
  in that time, the new process's CPU seconds and peak RSS.

`--own-cluster` runs all of it on a second, control-plane-only devcluster
with its own operator process (`--cluster-down` stops it), so a burst of
thousands of jobs does not slow down the shared cluster other people's
tests run on; without it, the shared devcluster and its operator are used.

The pods select a node label no node has, so the scheduler leaves them
Pending and nothing runs: only the controllers and the API server are
measured. Everything is created in one fresh namespace, deleted at the end.

Usage (devcluster up, operator running, e.g. after `./scripts/demo`):
    python -m bench.operator_scale [--jobs 200] [--nodes 2] [--window 60] [--writers 200]
    python -m bench.operator_scale --own-cluster --jobs 2000
    python -m bench.operator_scale --cluster-down   # stops what --own-cluster started
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import json
import os
import pathlib
import re
import shutil
import statistics
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

from kubernetes import client, config, watch

from cairn.api import trainingjob
from cairn.checkpoint import status_reporter
from cairn.devcluster import cluster, controlplane, paths, pki, processes
from tests import demo

GROUP, VERSION, PLURAL = trainingjob.GROUP, trainingjob.VERSION, trainingjob.PLURAL
COMMAND = ["python", "-c", "import time; time.sleep(3600)"]
NODE_SELECTOR = {"cairn.dev/bench": "no-such-node"}
CAIRN_LABEL = "cairn.dev/job-name"
BATCH_LABEL = "batch.kubernetes.io/job-name"
STATUS_PATCH = "PATCH trainingjobs/status"

# The bench's own cluster (--own-cluster)
#
# The shared devcluster serves every engineer's tests; a burst of thousands of
# jobs on it would slow their API server and etcd down. `cluster_up` starts
# another etcd, kube-apiserver, kube-controller-manager (its Job controller is
# the anchor) and kube-scheduler from the devcluster's own command lines
# (`cairn.devcluster.controlplane`), under their own state directory and
# ports, and an operator process of this checkout against it. No node agent,
# no S3, no bridge: the bench's pods are never scheduled, and nothing
# host-wide is created, so stopping it cannot touch the shared cluster. Every
# process is tracked by a pidfile under the state directory and stopped by PID
# (`--cluster-down`).

STATE_DIR = paths.cache_root() / "bench-cluster" / "state"
PORTS = controlplane.Ports(
    apiserver=16443, etcd_client=22379, etcd_peer=22380, s3=28333, kubelet_base=20250
)
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
OPERATOR = "operator"
LIVENESS_PORT = 18080
METRICS_PORT = 19090
READY_SECONDS = 120.0


def bench_target() -> cluster.Cluster:
    return cluster.Cluster(state=paths.StatePaths(root=STATE_DIR), ports=PORTS, nodes=())


def _alive(bench: cluster.Cluster, name: str) -> bool:
    tracked = processes.read_pidfile(bench.state.pidfile(name))
    return tracked is not None and processes.is_alive(tracked)


def _bench_spawn(bench: cluster.Cluster, name: str, argv: list[str], env: dict[str, str]) -> None:
    processes.spawn(
        name=name,
        argv=argv,
        log_path=bench.state.log(name),
        pidfile=bench.state.pidfile(name),
        env=env,
        cwd=bench.state.root,
    )


def _bench_wait(what: str, ready: object, seconds: float = READY_SECONDS) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if ready():  # type: ignore[operator]
            return
        time.sleep(0.5)
    raise SystemExit(f"bench cluster: {what} not ready within {seconds:.0f} s (logs: {STATE_DIR})")


def _kubeconfigs(bench: cluster.Cluster) -> None:
    for identity, path in (
        (pki.ADMIN, bench.state.admin_kubeconfig),
        (pki.CONTROLLER_MANAGER, bench.state.kubeconfig("controller-manager")),
        (pki.SCHEDULER, bench.state.kubeconfig("scheduler")),
    ):
        path.write_text(
            controlplane.kubeconfig(
                server=bench.server,
                pki=bench.state.pki,
                client_stem=identity.file_stem,
                user=identity.user,
            )
        )
        path.chmod(0o600)


def cluster_up() -> cluster.Cluster:
    """Start what is not running yet (bounded), install the CRD; the cluster."""
    bench = bench_target()
    state = bench.state
    for directory in (state.root, state.logs, state.pids, state.tmp):
        directory.mkdir(parents=True, exist_ok=True)
    pki.ensure(state.pki)
    _kubeconfigs(bench)
    env = dict(os.environ)
    env["TMPDIR"] = str(state.tmp)
    commands = {
        "etcd": controlplane.etcd_command(state=state, ports=PORTS),
        "kube-apiserver": controlplane.apiserver_command(state=state, ports=PORTS),
        "kube-controller-manager": controlplane.controller_manager_command(state=state),
        "kube-scheduler": controlplane.scheduler_command(state=state),
    }
    for name in COMPONENTS:
        if not _alive(bench, name):
            _bench_spawn(bench, name, commands[name], env)
        if name == "kube-apiserver":
            _bench_wait("the API server", lambda: cluster.api_get(bench, "/readyz")[0] == 200)
    _bench_wait(
        "the default ServiceAccount",
        lambda: (
            cluster.api_get(bench, "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200
        ),
    )
    demo.install_crd(bench_api_client(bench))
    stop_bench_operator(bench)  # a run measures the code as it is now
    snapshot_operator(bench)
    start_bench_operator(bench)
    url = f"http://127.0.0.1:{METRICS_PORT}/metrics"
    _bench_wait("the operator's /metrics", lambda: bool(operator_metrics(url)))
    time.sleep(5.0)  # kopf's first lists and watches: the idle RSS is after them
    return bench


def bench_api_client(bench: cluster.Cluster) -> client.ApiClient:
    configuration = client.Configuration()
    config.load_kube_config(str(bench.state.admin_kubeconfig), client_configuration=configuration)
    configuration.connection_pool_maxsize = 32
    return client.ApiClient(configuration)


def snapshot_operator(bench: cluster.Cluster) -> None:
    """Copy this checkout's `cairn.api` and `cairn.operator` under the state dir: the
    operator of a run (restarted for the cold start) is the code as the run began,
    not whatever the working tree holds a few minutes later."""
    root = bench.state.root / "snapshot" / "cairn"
    shutil.rmtree(root.parent, ignore_errors=True)
    repo = pathlib.Path(__file__).resolve().parent.parent
    for source in ("api/cairn/api", "operator/cairn/operator"):
        shutil.copytree(repo / source, root / pathlib.Path(source).name)


def start_bench_operator(bench: cluster.Cluster) -> int:
    """The operator against the bench cluster (its own liveness and metrics ports),
    from the snapshot when there is one; its PID."""
    if not _alive(bench, OPERATOR):
        env = dict(os.environ)
        env["KUBECONFIG"] = str(bench.state.admin_kubeconfig)
        env["TMPDIR"] = str(bench.state.tmp)
        snapshot = bench.state.root / "snapshot"
        if snapshot.exists():
            env["PYTHONPATH"] = os.pathsep.join(
                [str(snapshot), *filter(None, [os.environ.get("PYTHONPATH")])]
            )
        argv = [sys.executable, "-m", "cairn.operator", "--all-namespaces"]
        argv += ["--liveness", f"http://127.0.0.1:{LIVENESS_PORT}/healthz"]
        argv += ["--metrics-port", str(METRICS_PORT)]
        _bench_spawn(bench, OPERATOR, argv, env)
    tracked = processes.read_pidfile(bench.state.pidfile(OPERATOR))
    assert tracked is not None
    return tracked.pid


def stop_bench_operator(bench: cluster.Cluster) -> None:
    processes.stop_pidfile(bench.state.pidfile(OPERATOR), grace_seconds=15.0)


def cluster_down() -> None:
    """Stop the operator and the control plane, by PID, in reverse order."""
    bench = bench_target()
    stop_bench_operator(bench)
    for name in reversed(COMPONENTS):
        processes.stop_pidfile(bench.state.pidfile(name), grace_seconds=10.0)


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
            # The pods never start: without this the jobs of a long run restart
            # after the default 600 s (StartupDeadlineExceeded) in the middle of it.
            "startupDeadlineSeconds": 86400,
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
        self.last_change = time.monotonic()
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
                self.last_change = time.monotonic()
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


def operator_metrics(url: str) -> dict[str, float]:
    """The operator's /metrics: the job gauge summed over phases and the reconcile count."""
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            text = answer.read().decode()
    except OSError:
        return {}
    return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, float]:
    """Pure: ``jobs`` (sum of ``cairn_trainingjobs``) and ``reconciles``."""
    out = {"jobs": 0.0, "reconciles": 0.0}
    for line in text.splitlines():
        if line.startswith("cairn_trainingjobs{"):
            out["jobs"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("cairn_reconcile_duration_seconds_count "):
            out["reconciles"] = float(line.rsplit(" ", 1)[1])
    return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class ColdStart:
    observed_seconds: float
    steady_seconds: float
    writes: collections.Counter[str]
    requests: collections.Counter[str]
    operator_cpu: float
    rss_peak_kib: int
    reconciles: float


def cold_start(
    *,
    api: client.ApiClient,
    namespace: str,
    jobs: int,
    bench: cluster.Cluster,
    quiet: float,
    timeout: float,
) -> ColdStart:
    """Restart the bench cluster's operator with the jobs in place; time its way to steady state."""
    modified = Modified(api, namespace)
    modified.start()
    # Settled first, with the old operator still running (the stand-in writers'
    # last patches, transitions still under way): what follows is the restart's.
    quiet_since = time.monotonic()
    while time.monotonic() - max(quiet_since, modified.last_change) < quiet:
        time.sleep(0.5)
    stop_bench_operator(bench)
    modified.changes.clear()
    before = requests_by_kind(api)
    started = time.monotonic()
    pid = start_bench_operator(bench)
    rss = PeakRss(pid)
    rss.start()
    url = f"http://127.0.0.1:{METRICS_PORT}/metrics"
    observed_at: float | None = None
    seen: dict[str, float] = {}
    while time.monotonic() - started < timeout:
        time.sleep(0.5)
        seen = operator_metrics(url) or seen
        if observed_at is None and seen.get("jobs", 0) >= jobs and seen["reconciles"] >= jobs:
            observed_at = time.monotonic()
        if observed_at is not None:
            settled = max(observed_at, modified.last_change)
            if time.monotonic() - settled >= quiet:
                break
    else:
        print(f"WARNING: no steady state within {timeout} s (metrics {seen})")
    modified.stop()
    rss.stop.set()
    observed = (observed_at or float("nan")) - started
    return ColdStart(
        observed_seconds=observed,
        steady_seconds=max(observed_at or float("nan"), modified.last_change) - started,
        writes=modified.changes,
        requests=requests_by_kind(api) - before,
        operator_cpu=cpu_seconds(pid),
        rss_peak_kib=rss.peak,
        reconciles=seen.get("reconciles", float("nan")),
    )


def _print_cold(cold: ColdStart, jobs: int, quiet: float) -> None:
    mutating = {k: v for k, v in cold.requests.items() if k.split()[0] in MUTATING}
    print(
        f"cold start with {jobs} jobs: all observed after {cold.observed_seconds:.1f} s, "
        f"steady (no write for {quiet:.0f} s) after {cold.steady_seconds:.1f} s; "
        f"{cold.writes.total()} writes to the jobs, {sum(mutating.values())} mutating API "
        f"requests (all clients), {cold.requests.total()} requests in all; operator CPU "
        f"{cold.operator_cpu:.1f} s, RSS peak {cold.rss_peak_kib / 1024:.0f} MiB, "
        f"{cold.reconciles:.0f} reconciles"
    )
    for fields, count in cold.writes.most_common(6):
        print(f"    {count:6d}  {fields}")
    for kind, count in cold.requests.most_common(8):
        print(f"    {count:6d}  {kind}")


MUTATING = ("POST", "PUT", "PATCH", "DELETE")


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


def report_ratio(cairn: Burst, batch: Burst, rss: PeakRss, jobs: int) -> None:
    """The Job controller's burst and the ratio (each phase prints as it ends, so
    a run cut short keeps what it measured)."""
    _print_burst("Indexed Jobs (Job controller)", batch, jobs)
    if cairn.latencies and batch.latencies:
        print(
            "Cairn / Job controller: "
            f"p50 {statistics.median(cairn.latencies) / statistics.median(batch.latencies):.2f}, "
            f"p95 {cairn.quantile(0.95) / batch.quantile(0.95):.2f}, "
            f"max {cairn.latencies[-1] / batch.latencies[-1]:.2f}"
        )
    print(f"operator RSS: {rss.idle / 1024:.0f} MiB before, {rss.peak / 1024:.0f} MiB peak")


def report_window(window: Window, jobs: int) -> None:
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


def summary(
    *,
    jobs: int,
    cairn: Burst,
    batch: Burst,
    window: Window | None,
    rss: PeakRss,
    cold: ColdStart | None,
) -> dict[str, Any]:
    """The numbers of the docs' table, as one JSON-able dict."""
    out: dict[str, Any] = {"jobs": jobs}
    if cairn.latencies and batch.latencies:
        out["cairn_p50_p95_max"] = [
            round(statistics.median(cairn.latencies), 1),
            round(cairn.quantile(0.95), 1),
            round(cairn.latencies[-1], 1),
        ]
        out["job_p50_p95_max"] = [
            round(statistics.median(batch.latencies), 1),
            round(batch.quantile(0.95), 1),
            round(batch.latencies[-1], 1),
        ]
        out["ratio_p50_p95"] = [
            round(statistics.median(cairn.latencies) / statistics.median(batch.latencies), 2),
            round(cairn.quantile(0.95) / batch.quantile(0.95), 2),
        ]
    out["rss_mib_before_peak"] = [round(rss.idle / 1024), round(rss.peak / 1024)]
    out["cpu_s_cairn_job_window"] = [
        round(cairn.operator_cpu, 1),
        round(batch.operator_cpu, 1),
        round(window.operator_cpu, 1) if window else None,
    ]
    out["requests_per_job_cairn_job"] = [
        round(cairn.requests.total() / jobs, 1),
        round(batch.requests.total() / jobs, 1),
    ]
    if window is not None:
        minutes = window.seconds / 60
        out["writer_writes_per_job_min"] = round(
            window.writer_patches / window.writers / minutes, 2
        )
        others = max(0, window.job_writes - window.writer_patches)
        out["other_writes_per_job_min"] = round(others / jobs / minutes, 2)
    if cold is not None:
        out["cold_observed_s"] = round(cold.observed_seconds, 1)
        out["cold_steady_s"] = round(cold.steady_seconds, 1)
        out["cold_writes"] = cold.writes.total()
        out["cold_mutating_requests"] = sum(
            v for k, v in cold.requests.items() if k.split()[0] in MUTATING
        )
        out["cold_cpu_s"] = round(cold.operator_cpu, 1)
        out["cold_rss_mib"] = round(cold.rss_peak_kib / 1024)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--window", type=float, default=60, help="idle window, s (0: none)")
    parser.add_argument("--writers", type=int, default=200, help="stand-in writers in it")
    parser.add_argument(
        "--own-cluster",
        action="store_true",
        help="run on a second, control-plane-only devcluster (stop it with --cluster-down)",
    )
    parser.add_argument(
        "--quiet", type=float, default=10.0, help="cold start: seconds without a write = steady"
    )
    parser.add_argument("--cluster-down", action="store_true", help="stop the own cluster, exit")
    args = parser.parse_args()
    if args.cluster_down:
        cluster_down()
        print("bench cluster stopped")
        return
    if args.own_cluster:
        target = cluster_up()
        api = bench_api_client(target)
        pid = start_bench_operator(target)
    else:
        target = cluster.Cluster.default()
        config.load_kube_config(str(target.state.admin_kubeconfig))
        api = client.ApiClient(client.Configuration.get_default_copy())
        api.configuration.connection_pool_maxsize = 32
        demo.install_crd(api)
        pid = operator_pid(target)
    core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
    batch_api = client.BatchV1Api(api)
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
        _print_burst("TrainingJobs (Cairn operator)", cairn, args.jobs)
        print(f"operator RSS so far: {rss.idle / 1024:.0f} MiB before, {rss.peak / 1024:.0f} peak")
        window = None
        if args.window > 0 and args.writers > 0:
            window = idle_window(
                api=api,
                namespace=namespace,
                names=names[: args.writers],
                seconds=args.window,
                pid=pid,
            )
            report_window(window, args.jobs)
        rss.stop.set()
        if not pathlib.Path(f"/proc/{pid}").exists():
            print(f"WARNING: operator pid {pid} exited during the run: the numbers are not valid")
        cold = None
        if args.own_cluster:
            cold = cold_start(
                api=api,
                namespace=namespace,
                jobs=args.jobs,
                bench=target,
                quiet=args.quiet,
                timeout=min(args.timeout, 600.0),
            )
            _print_cold(cold, args.jobs, args.quiet)
            pid = start_bench_operator(target)
            common["pid"] = pid
        batch_names = [f"batch-{i:04d}" for i in range(args.jobs)]
        batch = burst(
            label=BATCH_LABEL,
            names=batch_names,
            create=lambda n: batch_api.create_namespaced_job(namespace, indexed_job(n, args.nodes)),
            timeout=args.timeout,
            **common,
        )
        report_ratio(cairn, batch, rss, args.jobs)
        print(
            "SUMMARY "
            + json.dumps(
                summary(jobs=args.jobs, cairn=cairn, batch=batch, window=window, rss=rss, cold=cold)
            )
        )
    finally:
        teardown(api, namespace, timeout=args.timeout)


def teardown(api: client.ApiClient, namespace: str, *, timeout: float) -> None:
    """The TrainingJobs first (their pods go with them), then the namespace: a
    namespace deletion alone removes the pods first, and the operator would
    restart every job it sees lose its pods."""
    started = time.monotonic()
    custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)
    asked = -float("inf")
    while time.monotonic() - started < timeout:
        if time.monotonic() - asked > 60.0:
            asked = time.monotonic()
            try:
                custom.delete_collection_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
            except client.ApiException as error:
                # 504 with thousands of jobs: the server goes on deleting; ask again later.
                print(f"  deleting the TrainingJobs: {error.status} {error.reason}; waiting")
        left = custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, limit=1)
        if not left["items"]:
            break
        time.sleep(2.0)
    core.delete_namespace(namespace)
    print(f"namespace {namespace} deleted ({time.monotonic() - started:.1f} s)")


if __name__ == "__main__":
    main()
