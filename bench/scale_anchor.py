"""The fair scale anchor (issue 25): Cairn's operator against a Job controller
that is not held back by its client's rate limit.

`bench/operator_scale.py` anchors Cairn's creation → pods latency to
kube-controller-manager's Job controller. With KCM's defaults (client QPS 20,
burst 30, `--concurrent-job-syncs` 5) the Job controller creates pods at a
flat ~5.7 jobs/s whatever the load: that anchor measures a rate limit. Cairn's
operator has no client-side rate limit (the Python client has none) and
reconciles on `tunables.ReconcileTunables.api_threads` (16) threads. This
bench restarts the bench cluster's KCM (never the shared devcluster's) once
per setting:

- ``fair``: ``--concurrent-job-syncs`` = the operator's API threads (16) and
  ``--kube-api-qps``/``--kube-api-burst`` = 1000/2000, far above what this
  API server serves on 2 cores (it takes ~60 creates/s), so the limiter never
  binds, as the operator's (absent) one never does;
- ``default``: KCM's own defaults, the anchor the old figures used.

Each round runs both bursts (N TrainingJobs, N Indexed Jobs) in a fresh
namespace, Cairn first in even rounds and the Job controller first in odd
ones, and measures the CPU of both processes (/proc/PID/stat) over each burst.
The headline is Cairn ÷ Job controller in latency and in CPU (the operator's
over the Cairn burst ÷ KCM's over the Job burst; KCM's figure includes its
other controllers, which also serve Cairn's ServiceAccounts and Services in
the other burst). The run leaves a JSON record under `bench/results/` and
puts KCM back on its default flags.

Usage (on the bench's own control-plane-only cluster, started if needed;
`python -m bench.operator_scale --cluster-down` stops it):
    PYTHONPATH=. python bench/scale_anchor.py [--jobs 200] [--rounds 2]
Not part of the test suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import os
import statistics
import time
import uuid
from typing import Any

import operator_scale as scale  # bench/, next to this script
import record
from kubernetes import client

from cairn.devcluster import build, cluster, controlplane, processes
from cairn.operator.core import tunables

KCM = "kube-controller-manager"
KCM_READY = '"Caches are synced" controller="job"'
NAMESPACE_GONE_SECONDS = 300.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class KcmSetting:
    """KCM's client rate limit and Job syncs; None: KCM's default."""

    name: str
    qps: int | None = None
    burst: int | None = None
    job_syncs: int | None = None

    def flags(self) -> list[str]:
        """Pure: the flags that differ from the devcluster's command line."""
        out = []
        if self.qps is not None:
            out.append(f"--kube-api-qps={self.qps}")
        if self.burst is not None:
            out.append(f"--kube-api-burst={self.burst}")
        if self.job_syncs is not None:
            out.append(f"--concurrent-job-syncs={self.job_syncs}")
        return out


FAIR = KcmSetting(
    name="fair", qps=1000, burst=2000, job_syncs=tunables.DEFAULT.reconcile.api_threads
)
DEFAULT = KcmSetting(name="default")


def restart_kcm(bench: cluster.Cluster, setting: KcmSetting) -> int:
    """Stop the bench cluster's KCM (by its pidfile) and start it with `setting`;
    its PID once its Job controller has synced its caches (bounded)."""
    pidfile, log = bench.state.pidfile(KCM), bench.state.log(KCM)
    processes.stop_pidfile(pidfile, grace_seconds=10.0)
    offset = log.stat().st_size if log.exists() else 0
    argv = controlplane.controller_manager_command(state=bench.state) + setting.flags()
    env = dict(os.environ)
    env["TMPDIR"] = str(bench.state.tmp)
    tracked = processes.spawn(
        name=KCM, argv=argv, log_path=log, pidfile=pidfile, env=env, cwd=bench.state.root
    )

    def ready() -> bool:
        with log.open("rb") as handle:
            handle.seek(offset)
            return KCM_READY.encode() in handle.read()

    scale._bench_wait(f"{KCM} ({setting.name})", ready)
    return tracked.pid


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pair:
    """One burst of each kind, in one namespace, and both processes' CPU over each."""

    cairn: scale.Burst
    batch: scale.Burst
    kcm_cpu_cairn: float
    kcm_cpu_batch: float


def _timed_burst(
    *, kind: str, kcm_pid: int, jobs: int, ranks: int, **common: Any
) -> tuple[scale.Burst, float]:
    """One burst (`kind` "cairn" or "batch"); KCM's CPU seconds over it."""
    api, namespace = common["api"], common["namespace"]
    names = [f"{kind}-{i:04d}" for i in range(jobs)]
    if kind == "cairn":
        custom = client.CustomObjectsApi(api)
        label = scale.CAIRN_LABEL

        def create(name: str) -> Any:
            return custom.create_namespaced_custom_object(
                scale.GROUP, scale.VERSION, namespace, scale.PLURAL, scale.training_job(name, ranks)
            )
    else:
        batch_api = client.BatchV1Api(api)
        label = scale.BATCH_LABEL

        def create(name: str) -> Any:
            return batch_api.create_namespaced_job(namespace, scale.indexed_job(name, ranks))

    before = scale.cpu_seconds(kcm_pid)
    result = scale.burst(label=label, names=names, ranks=ranks, create=create, **common)
    return result, scale.cpu_seconds(kcm_pid) - before


def one_round(
    *, api: client.ApiClient, operator_pid: int, kcm_pid: int, jobs: int, ranks: int,
    cairn_first: bool, timeout: float,
) -> Pair:  # fmt: skip
    """Both bursts in a fresh namespace, in the given order; the namespace deleted
    and gone (bounded) before it returns, so the next round starts clean."""
    core = client.CoreV1Api(api)
    namespace = f"anchor-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    common = {"api": api, "namespace": namespace, "pid": operator_pid, "timeout": timeout}
    out: dict[str, tuple[scale.Burst, float]] = {}
    try:
        for kind in ("cairn", "batch") if cairn_first else ("batch", "cairn"):
            out[kind] = _timed_burst(kind=kind, kcm_pid=kcm_pid, jobs=jobs, ranks=ranks, **common)
    finally:
        scale.teardown(api, namespace, timeout=timeout)
        _wait_namespace_gone(core, namespace)
    return Pair(
        cairn=out["cairn"][0],
        batch=out["batch"][0],
        kcm_cpu_cairn=out["cairn"][1],
        kcm_cpu_batch=out["batch"][1],
    )


def _wait_namespace_gone(core: client.CoreV1Api, namespace: str) -> None:
    deadline = time.monotonic() + NAMESPACE_GONE_SECONDS
    while time.monotonic() < deadline:
        try:
            core.read_namespace(namespace)
        except client.ApiException as error:
            if error.status == 404:
                return
            raise
        time.sleep(1.0)
    print(f"WARNING: namespace {namespace} still there after {NAMESPACE_GONE_SECONDS:.0f} s")


def _triple(burst: scale.Burst) -> list[float]:
    lat = burst.latencies
    return [round(statistics.median(lat), 2), round(burst.quantile(0.95), 2), round(lat[-1], 2)]


def figures(pair: Pair, *, jobs: int) -> dict[str, Any]:
    """Pure: one round's figures (latencies in s, CPU in s, requests per job)."""
    cairn, batch = pair.cairn, pair.batch
    out: dict[str, Any] = {
        "create_s_cairn_job": [round(cairn.create_seconds, 1), round(batch.create_seconds, 1)],
        "pods_for": [len(cairn.latencies), len(batch.latencies)],
        "operator_cpu_s_cairn_burst": round(cairn.operator_cpu, 2),
        "operator_cpu_s_job_burst": round(batch.operator_cpu, 2),
        "kcm_cpu_s_cairn_burst": round(pair.kcm_cpu_cairn, 2),
        "kcm_cpu_s_job_burst": round(pair.kcm_cpu_batch, 2),
        "requests_per_job_cairn_job": [
            round(cairn.requests.total() / jobs, 1),
            round(batch.requests.total() / jobs, 1),
        ],
    }
    if pair.kcm_cpu_batch > 0:
        out["ratio_cpu"] = round(cairn.operator_cpu / pair.kcm_cpu_batch, 2)
    if cairn.latencies and batch.latencies:
        out["cairn_p50_p95_max_s"] = _triple(cairn)
        out["job_p50_p95_max_s"] = _triple(batch)
        out["ratio_p50_p95"] = [
            round(statistics.median(cairn.latencies) / statistics.median(batch.latencies), 2),
            round(cairn.quantile(0.95) / batch.quantile(0.95), 2),
        ]
    return out


def headline(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Pure: the median over rounds of each ratio, and each round's, for one setting."""
    out: dict[str, Any] = {}
    complete = [r for r in rounds if "ratio_p50_p95" in r and "ratio_cpu" in r]
    for key, values in (
        ("ratio_p50", [r["ratio_p50_p95"][0] for r in complete]),
        ("ratio_p95", [r["ratio_p50_p95"][1] for r in complete]),
        ("ratio_cpu", [r["ratio_cpu"] for r in complete]),
    ):
        out[key + "_median"] = round(statistics.median(values), 2) if values else None
        out[key + "_each"] = values
    return out


def run(*, jobs: int, ranks: int, rounds: int, timeout: float, out: dict[str, Any]) -> None:
    """Every setting, `rounds` rounds each, into `out` as each round ends (a run
    cut short keeps what it measured); KCM back on its defaults at the end."""
    bench = scale.cluster_up()
    api = scale.bench_api_client(bench)
    operator_pid = scale.start_bench_operator(bench)
    try:
        for setting in (FAIR, DEFAULT):
            kcm_pid = restart_kcm(bench, setting)
            rows: list[dict[str, Any]] = []
            out[setting.name] = {"kcm_flags": setting.flags(), "rounds": rows}
            for index in range(rounds):
                cairn_first = index % 2 == 0
                load = os.getloadavg()[0]
                pair = one_round(
                    api=api, operator_pid=operator_pid, kcm_pid=kcm_pid, jobs=jobs, ranks=ranks,
                    cairn_first=cairn_first, timeout=timeout,
                )  # fmt: skip
                row = {"round": index, "cairn_first": cairn_first, "load_1min_start": load}
                row |= figures(pair, jobs=jobs)
                print(f"{setting.name} round {index}: {row}", flush=True)
                rows.append(row)
                out[setting.name]["headline"] = headline(rows)
    finally:
        restart_kcm(bench, DEFAULT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=2, help="ranks per job")
    parser.add_argument("--rounds", type=int, default=2, help="per KCM setting")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    env = record.environment()
    env["versions"]["kubernetes"] = build.KUBERNETES.version
    env["versions"]["kopf"] = importlib.metadata.version("kopf")
    results: dict[str, Any] = {}
    try:
        run(jobs=args.jobs, ranks=args.nodes, rounds=args.rounds, timeout=args.timeout, out=results)
    finally:
        _record(args=args, env=env, results=results)


def _record(*, args: argparse.Namespace, env: dict[str, Any], results: dict[str, Any]) -> None:
    """Print each setting's headline; write the JSON record (also of a run cut short)."""
    for name, setting in results.items():
        flags = " ".join(setting["kcm_flags"]) or "KCM defaults"
        print(f"{name} ({flags}): {setting.get('headline')}")
    complete = all(len(s["rounds"]) == args.rounds for s in results.values())
    path = record.write(
        bench="operator-scale-anchor",
        tag=str(args.jobs),
        env=env,
        params={
            "jobs": args.jobs,
            "ranks": args.nodes,
            "rounds_per_setting": args.rounds,
            "client_threads": 16,
            "operator_api_threads": tunables.DEFAULT.reconcile.api_threads,
            "seed": None,  # nothing random: the order alternates by round
            "cluster": "the bench's own control-plane-only cluster",
            "complete": complete and len(results) == 2,
        },
        figures=results,
    )
    print(f"record: {path}")


if __name__ == "__main__":
    main()
