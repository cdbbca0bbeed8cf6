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

With ``--jobset`` each round also runs a third burst, N JobSets of the same
shape (one replicated job: an Indexed Job of the same pods), handled by
JobSet's manager (`cairn.devcluster.jobset`, built from its Go module on
first use and started on the bench cluster only) and, for the pods, by the
same KCM; the order of the three rotates by round. The manager's client
limit follows the setting (the fair one's 1000/2000, else JobSet's own
500/500); its reconcile concurrency is controller-runtime's default of one
worker: JobSet v0.12.0 has no flag or setting for it. The JobSet CPU figure
is the manager's plus KCM's over the JobSet burst (both do that work). The
run removes the manager, its webhooks and its CRD at the end.
The headline is Cairn ÷ Job controller in latency and in CPU (the operator's
over the Cairn burst ÷ KCM's over the Job burst; KCM's figure includes its
other controllers, which also serve Cairn's ServiceAccounts and Services in
the other burst). The run leaves a JSON record under `bench/results/` and
puts KCM back on its default flags.

Usage (on the bench's own control-plane-only cluster, started if needed;
`python -m bench.operator_scale --cluster-down` stops it):
    PYTHONPATH=. python bench/scale_anchor.py [--jobs 200] [--rounds 2]
        [--jobset] [--settings fair,default]
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

from cairn.devcluster import build, cluster, controlplane, jobset, processes
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

    def jobset_limits(self) -> jobset.ClientLimits:
        """Pure: JobSet's manager gets the same client limit as KCM, else its own default."""
        default = jobset.ClientLimits()
        return jobset.ClientLimits(
            qps=self.qps if self.qps is not None else default.qps,
            burst=self.burst if self.burst is not None else default.burst,
        )


FAIR = KcmSetting(
    name="fair", qps=1000, burst=2000, job_syncs=tunables.DEFAULT.reconcile.api_threads
)
DEFAULT = KcmSetting(name="default")
SETTINGS = {s.name: s for s in (FAIR, DEFAULT)}
KINDS = ("cairn", "batch", "jobset")


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
    """One burst of each kind, in one namespace, and the processes' CPU over each
    (the JobSet burst and its figures only with ``--jobset``)."""

    cairn: scale.Burst
    batch: scale.Burst
    kcm_cpu_cairn: float
    kcm_cpu_batch: float
    jobset: scale.Burst | None = None
    kcm_cpu_jobset: float = 0.0
    jobset_cpu_jobset: float = 0.0


def jobset_body(name: str, ranks: int) -> dict[str, Any]:
    """Pure: the JobSet twin of `scale.indexed_job`: the same pod spec, `ranks` pods."""
    pod_spec = scale.indexed_job(name, ranks)["spec"]["template"]["spec"]
    return jobset.jobset(name, replicas=ranks, pod_spec=pod_spec)


def _creator(*, kind: str, api: client.ApiClient, namespace: str, ranks: int) -> Any:
    """(pod label, create(name)) for one burst kind."""
    if kind == "cairn":
        custom = client.CustomObjectsApi(api)
        return scale.CAIRN_LABEL, lambda name: custom.create_namespaced_custom_object(
            scale.GROUP, scale.VERSION, namespace, scale.PLURAL, scale.training_job(name, ranks)
        )
    if kind == "jobset":
        custom = client.CustomObjectsApi(api)
        group, version = jobset.API_VERSION.split("/")
        return jobset.JOBSET_NAME_LABEL, lambda name: custom.create_namespaced_custom_object(
            group, version, namespace, "jobsets", jobset_body(name, ranks)
        )
    batch_api = client.BatchV1Api(api)
    return scale.BATCH_LABEL, lambda name: batch_api.create_namespaced_job(
        namespace, scale.indexed_job(name, ranks)
    )


def _timed_burst(
    *, kind: str, watch_pids: dict[str, int], jobs: int, ranks: int, **common: Any
) -> tuple[scale.Burst, dict[str, float]]:
    """One burst of `kind` (one of KINDS); each watched process's CPU seconds over it."""
    names = [f"{kind}-{i:04d}" for i in range(jobs)]
    label, create = _creator(
        kind=kind, api=common["api"], namespace=common["namespace"], ranks=ranks
    )
    before = {name: scale.cpu_seconds(pid) for name, pid in watch_pids.items()}
    result = scale.burst(label=label, names=names, ranks=ranks, create=create, **common)
    return result, {name: scale.cpu_seconds(pid) - before[name] for name, pid in watch_pids.items()}


def round_order(kinds: tuple[str, ...], index: int) -> tuple[str, ...]:
    """Pure: the burst order of round `index`: `kinds` rotated by the round, so each
    kind goes first in turn (with two kinds: Cairn first in even rounds)."""
    shift = index % len(kinds)
    return kinds[shift:] + kinds[:shift]


def one_round(
    *, api: client.ApiClient, operator_pid: int, watch_pids: dict[str, int], jobs: int,
    ranks: int, order: tuple[str, ...], timeout: float,
) -> Pair:  # fmt: skip
    """Every burst in `order` in a fresh namespace; the namespace deleted and gone
    (bounded) before it returns, so the next round starts clean. `watch_pids`:
    "kcm" and, with a JobSet burst, "jobset"."""
    core = client.CoreV1Api(api)
    namespace = f"anchor-{uuid.uuid4().hex[:6]}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    common = {"api": api, "namespace": namespace, "pid": operator_pid, "timeout": timeout}
    out: dict[str, tuple[scale.Burst, dict[str, float]]] = {}
    try:
        for kind in order:
            out[kind] = _timed_burst(
                kind=kind, watch_pids=watch_pids, jobs=jobs, ranks=ranks, **common
            )
    finally:
        scale.teardown(api, namespace, timeout=timeout)
        _wait_namespace_gone(core, namespace)
    third = out.get("jobset")
    return Pair(
        cairn=out["cairn"][0],
        batch=out["batch"][0],
        kcm_cpu_cairn=out["cairn"][1]["kcm"],
        kcm_cpu_batch=out["batch"][1]["kcm"],
        jobset=third[0] if third else None,
        kcm_cpu_jobset=third[1]["kcm"] if third else 0.0,
        jobset_cpu_jobset=third[1].get("jobset", 0.0) if third else 0.0,
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
    if pair.jobset is not None:
        out |= jobset_figures(pair, jobs=jobs)
    return out


def jobset_figures(pair: Pair, *, jobs: int) -> dict[str, Any]:
    """Pure: the JobSet column of one round, and Cairn ÷ JobSet. JobSet's CPU is its
    manager's plus KCM's over the JobSet burst: its pods come from KCM's Job controller."""
    cairn, third = pair.cairn, pair.jobset
    assert third is not None
    cpu = pair.jobset_cpu_jobset + pair.kcm_cpu_jobset
    out: dict[str, Any] = {
        "jobset_create_s": round(third.create_seconds, 1),
        "jobset_pods_for": len(third.latencies),
        "jobset_cpu_s_jobset_burst": round(pair.jobset_cpu_jobset, 2),
        "kcm_cpu_s_jobset_burst": round(pair.kcm_cpu_jobset, 2),
        "requests_per_job_jobset": round(third.requests.total() / jobs, 1),
    }
    if cpu > 0:
        out["ratio_cpu_vs_jobset"] = round(cairn.operator_cpu / cpu, 2)
    if cairn.latencies and third.latencies:
        out["jobset_p50_p95_max_s"] = _triple(third)
        out["ratio_p50_p95_vs_jobset"] = [
            round(statistics.median(cairn.latencies) / statistics.median(third.latencies), 2),
            round(cairn.quantile(0.95) / third.quantile(0.95), 2),
        ]
    return out


def headline(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Pure: the median over rounds of each ratio, and each round's, for one setting
    (against JobSet too when any round ran a JobSet burst)."""
    out = _medians(rounds, latency="ratio_p50_p95", cpu="ratio_cpu", suffix="")
    if any("jobset_pods_for" in r for r in rounds):
        latency, cpu = "ratio_p50_p95_vs_jobset", "ratio_cpu_vs_jobset"
        out |= _medians(rounds, latency=latency, cpu=cpu, suffix="_vs_jobset")
    return out


def _medians(
    rounds: list[dict[str, Any]], *, latency: str, cpu: str, suffix: str
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    complete = [r for r in rounds if latency in r and cpu in r]
    for key, values in (
        ("ratio_p50", [r[latency][0] for r in complete]),
        ("ratio_p95", [r[latency][1] for r in complete]),
        ("ratio_cpu", [r[cpu] for r in complete]),
    ):
        out[f"{key}{suffix}_median"] = round(statistics.median(values), 2) if values else None
        out[f"{key}{suffix}_each"] = values
    return out


def run(
    *, jobs: int, ranks: int, rounds: int, timeout: float, settings: list[KcmSetting],
    with_jobset: bool, out: dict[str, Any],
) -> None:  # fmt: skip
    """Every setting, `rounds` rounds each, into `out` as each round ends (a run
    cut short keeps what it measured); KCM back on its defaults at the end, and
    JobSet's manager, webhooks and CRD removed."""
    bench = scale.cluster_up()
    api = scale.bench_api_client(bench)
    operator_pid = scale.start_bench_operator(bench)
    kinds = KINDS if with_jobset else KINDS[:2]
    try:
        for setting in settings:
            watch_pids = {"kcm": restart_kcm(bench, setting)}
            out[setting.name] = {"kcm_flags": setting.flags(), "rounds": []}
            if with_jobset:
                limits = setting.jobset_limits()
                out[setting.name]["jobset_client_qps_burst"] = [limits.qps, limits.burst]
                out[setting.name]["jobset_build_s"] = round(jobset.up(bench, limits=limits), 1)
                watch_pids["jobset"] = jobset.pid(bench)
            for index in range(rounds):
                order = round_order(kinds, index)
                load = os.getloadavg()[0]
                pair = one_round(
                    api=api, operator_pid=operator_pid, watch_pids=watch_pids, jobs=jobs,
                    ranks=ranks, order=order, timeout=timeout,
                )  # fmt: skip
                row = {"round": index, "order": list(order), "load_1min_start": load}
                row |= figures(pair, jobs=jobs)
                print(f"{setting.name} round {index}: {row}", flush=True)
                out[setting.name]["rounds"].append(row)
                out[setting.name]["headline"] = headline(out[setting.name]["rounds"])
    finally:
        if with_jobset:
            jobset.down(bench)
        restart_kcm(bench, DEFAULT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=2, help="ranks per job")
    parser.add_argument("--rounds", type=int, default=2, help="per KCM setting")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--jobset", action="store_true", help="a third burst: N JobSets")
    parser.add_argument(
        "--settings", default="fair,default", help="comma-separated: " + ",".join(SETTINGS)
    )
    args = parser.parse_args()
    args.settings = parse_settings(args.settings)
    env = record.environment()
    env["versions"]["kubernetes"] = build.KUBERNETES.version
    env["versions"]["kopf"] = importlib.metadata.version("kopf")
    results: dict[str, Any] = {}
    try:
        run(
            jobs=args.jobs, ranks=args.nodes, rounds=args.rounds, timeout=args.timeout,
            settings=args.settings, with_jobset=args.jobset, out=results,
        )  # fmt: skip
    finally:
        _record(args=args, env=env, results=results)


def parse_settings(text: str) -> list[KcmSetting]:
    """Pure: `--settings` ("fair,default") as settings, in the order given."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SETTINGS]
    if unknown or not names:
        raise SystemExit(f"--settings: {text!r}: choose from {', '.join(SETTINGS)}")
    return [SETTINGS[name] for name in names]


def _record(*, args: argparse.Namespace, env: dict[str, Any], results: dict[str, Any]) -> None:
    """Print each setting's headline; write the JSON record (also of a run cut short)."""
    for name, setting in results.items():
        flags = " ".join(setting["kcm_flags"]) or "KCM defaults"
        print(f"{name} ({flags}): {setting.get('headline')}")
    complete = all(len(s["rounds"]) == args.rounds for s in results.values())
    path = record.write(
        bench="operator-scale-anchor" + ("-jobset" if args.jobset else ""),
        tag=str(args.jobs),
        env=env,
        params={
            "jobs": args.jobs,
            "ranks": args.nodes,
            "rounds_per_setting": args.rounds,
            "client_threads": 16,
            "operator_api_threads": tunables.DEFAULT.reconcile.api_threads,
            "seed": None,  # nothing random: the order rotates by round
            "cluster": "the bench's own control-plane-only cluster",
            "settings": [s.name for s in args.settings],
            "jobset": jobset.JOBSET_VERSION if args.jobset else None,
            "complete": complete and len(results) == len(args.settings),
        },
        figures=results,
    )
    print(f"record: {path}")


if __name__ == "__main__":
    main()
