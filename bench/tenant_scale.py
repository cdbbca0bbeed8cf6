"""One hostile tenant beside 200 healthy jobs (issue 20, item 4 and "Must show").

On the devcluster (its API server and SeaweedFS), one run sets up:

- ``--jobs`` healthy jobs in a namespace and bucket of their own, each with
  ``--steps`` committed steps (as ``bench/tenant_isolation.py`` writes them);
- one hostile tenant (another namespace and bucket) with three jobs:
  ``flood``, whose prefix holds ``--objects`` tiny objects (concurrent PUTs,
  timed) and a 16 MiB manifest; ``big``, a good step and a 16 MiB manifest
  beside it; ``hung``, naming a store that accepts connections and never
  answers.

Then an operator process of its own (this file with ``--operator``: the
operator's ``runtime.Runtime`` S3 loop, threads, deadline, ``core.s3fair``
and ``s3pass``, no kopf; the shared operator leaves these jobs alone, they
say ``spec.managedBy: tests.cairn.dev/tenant-caps``) runs rounds of first
passes, a fresh runtime per round: a warm-up (not counted), then ``--rounds``
times the healthy jobs alone and beside the hostile ones (seen first). It
reports the healthy jobs' time from first sight to their first pass done
(status patched) alone and beside (p50, p95, mean, ratio), its peak RSS
(``VmHWM``; ``VmRSS`` sampled) against the chart's memory limit, the keys
listed per pass of the hostile prefix, how long the hostile passes took and
what the hostile jobs' status says. Everything it made is deleted at the
end. Writes ``bench/results/tenant-scale-<jobs>-*.json``.

Usage (devcluster up, from the repository root):
``PYTHONPATH=. python bench/tenant_scale.py [--jobs 200] [--objects 100000] [--rounds 3]
[--keep-flood] [--threads N]``. With ``--keep-flood`` the flooded prefix lives
in a bucket of its own (``cairn-bench-flood``) that is kept at the end, and a
later run with the flag reuses its objects when they are all there (its owner
record is removed so the new ``flood`` job can claim it); the record says
which it did (``flood_reused``). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import copy
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

MiB = 1024 * 1024
FLOOD, BIG, HUNG = "flood", "big", "hung"
FLOOD_BUCKET = "cairn-bench-flood"
"""Where ``--keep-flood`` keeps the flooded prefix between runs."""
CHART_VALUES = pathlib.Path(__file__).resolve().parent.parent / "charts/cairn/values.yaml"


# ---------------------------------------------------------------- operator side


def status_kib(field: str) -> int:
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise LookupError(field)


class RssSampler(threading.Thread):
    """The highest VmRSS seen, every 50 ms (VmHWM is the kernel's own peak)."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        self.peak_kib = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            self.peak_kib = max(self.peak_kib, status_kib("VmRSS"))


class ListedKeys:
    """Keys each ``ListObjectsV2`` answer carried, by the prefix it listed."""

    def __init__(self) -> None:
        self.by_prefix: dict[str, int] = {}
        self.lock = threading.Lock()

    def hook(self, parsed: dict[str, Any] | None = None, **_: Any) -> None:
        if not parsed or "Prefix" not in parsed:
            return
        with self.lock:
            prefix = str(parsed["Prefix"])
            self.by_prefix[prefix] = self.by_prefix.get(prefix, 0) + len(parsed.get("Contents", []))


def as_cairns(made: dict[str, Any]) -> dict[str, Any]:
    """The body the loop plans from: the job as if Cairn managed it."""
    body = copy.deepcopy(made)
    body["spec"].pop("managedBy", None)
    return body


async def one_round(
    api: Any, *, healthy: list[dict[str, Any]], hostile: list[dict[str, Any]], settings: Any
) -> tuple[list[float], dict[str, float], dict[str, int]]:
    """Seconds from first sight to each healthy job's first pass done, in a runtime of
    its own with ``hostile`` seen first; when each hostile pass (not the hung
    one, which ends at its deadline) was done, waited for so no round overlaps;
    and the listing slices each hostile job's first pass took (``core.s3slice``)."""
    from cairn.operator import runtime

    state = runtime.Runtime(api=api, settings=settings)
    task = asyncio.create_task(state.s3_loop.run())
    try:
        start = time.monotonic()
        for body in hostile + healthy:
            meta = body["metadata"]
            state.s3_loop.update((meta["namespace"], meta["name"]), as_cairns(body))
        keys = [(b["metadata"]["namespace"], b["metadata"]["name"]) for b in healthy]
        awaited = [
            (b["metadata"]["namespace"], b["metadata"]["name"])
            for b in hostile
            if b["metadata"]["name"] != HUNG
        ]
        done: dict[tuple[str, str], float] = {}
        while len(done) < len(keys) + len(awaited):
            if time.monotonic() - start > 600:
                raise TimeoutError(f"first passes done after 600 s: {len(done)}")
            for key in keys + awaited:
                if key not in done and state.s3_loop.passes[(key, "periodic")]:
                    done[key] = time.monotonic() - start
            await asyncio.sleep(0.01)
        slices = {k[1]: state.s3_loop.slices[k] for k in awaited}
        return [done[k] for k in keys], {k[1]: done[k] for k in awaited}, slices
    finally:
        task.cancel()
        state.close()


async def hung_reported(
    api: Any, custom: Any, *, body: dict[str, Any], settings: Any, seconds: float
) -> float:
    """Seconds until the hung job's status says its pass was abandoned (a runtime of
    its own, the hung job alone)."""
    from cairn.api import trainingjob
    from cairn.operator import runtime

    state = runtime.Runtime(api=api, settings=settings)
    task = asyncio.create_task(state.s3_loop.run())
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]

    def storage() -> dict[str, Any]:
        got = custom.get_namespaced_custom_object(
            trainingjob.GROUP, trainingjob.VERSION, ns, trainingjob.PLURAL, name
        )
        return dict((got.get("status") or {}).get("storage") or {})

    try:
        start = time.monotonic()
        state.s3_loop.update((ns, name), as_cairns(body))
        while time.monotonic() - start < seconds:
            if "abandoned" in (await asyncio.to_thread(storage)).get("lastError", ""):
                return time.monotonic() - start
            await asyncio.sleep(0.5)
        raise TimeoutError(f"the hung job's pass was not reported abandoned in {seconds} s")
    finally:
        task.cancel()
        state.close()


def operator_side(spec: dict[str, Any]) -> dict[str, Any]:
    """The rounds, in this process (the operator's); returns the figures."""
    from kubernetes import client, config

    from cairn.api import trainingjob
    from cairn.operator import kubeapi, s3clients
    from cairn.operator.core import tunables

    where = (trainingjob.GROUP, trainingjob.VERSION)

    sampler = RssSampler()
    sampler.start()
    listed = ListedKeys()
    make = s3clients.make_client

    def counted(*args: Any, **kw: Any) -> Any:
        made = make(*args, **kw)
        made.meta.events.register("after-call.s3.ListObjectsV2", listed.hook)
        return made

    s3clients.make_client = counted
    api_client = config.new_client_from_config(config_file=spec["kubeconfig"])
    api = kubeapi.KubeApi.of(api_client)
    custom = client.CustomObjectsApi(api_client)

    def jobs(namespace: str) -> list[dict[str, Any]]:
        got = custom.list_namespaced_custom_object(*where, namespace, trainingjob.PLURAL)
        return sorted(got["items"], key=lambda j: j["metadata"]["name"])

    healthy, hostile = jobs(spec["healthy_ns"]), jobs(spec["hostile_ns"])
    settings = tunables.Settings(
        storage=tunables.StorageLoop(
            initial_delay_seconds=0.05,
            interval_seconds=600.0,
            pass_deadline_seconds=spec["pass_deadline"],
            threads=spec["threads"],
        )
    )
    rss_idle = status_kib("VmRSS")
    kw: dict[str, Any] = {"healthy": healthy, "settings": settings}
    asyncio.run(one_round(api, hostile=hostile, **kw))  # warm-up: clients, status writes
    alone: list[float] = []
    beside: list[float] = []
    hostile_seconds: dict[str, list[float]] = {}
    flood_prefix = f"runs/{FLOOD}/"
    flood_listed: list[int] = []
    flood_slices: list[int] = []
    for _ in range(spec["rounds"]):
        alone += asyncio.run(one_round(api, hostile=[], **kw))[0]
        before = listed.by_prefix.get(flood_prefix, 0)
        seconds, ended, slices = asyncio.run(one_round(api, hostile=hostile, **kw))
        beside += seconds
        flood_slices.append(slices.get(FLOOD, 0))
        flood_listed.append(listed.by_prefix.get(flood_prefix, 0) - before)
        for name, at in ended.items():
            hostile_seconds.setdefault(name, []).append(round(at, 3))
    hung = next(j for j in hostile if j["metadata"]["name"] == HUNG)
    reported = asyncio.run(
        hung_reported(api, custom, body=hung, settings=settings, seconds=spec["pass_deadline"] + 60)
    )
    hostile_seconds[HUNG] = [round(reported, 3)]
    sampler.stop.set()
    status = {
        j["metadata"]["name"]: (
            api.custom.get_namespaced_custom_object(
                *where, spec["hostile_ns"], trainingjob.PLURAL, j["metadata"]["name"]
            ).get("status", {})
        ).get("storage", {})
        for j in hostile
    }
    return {
        "alone": alone,
        "beside": beside,
        "rss_idle_kib": rss_idle,
        "rss_sampled_peak_kib": sampler.peak_kib,
        "vm_hwm_kib": status_kib("VmHWM"),
        "flood_keys_listed_per_pass": flood_listed,
        "flood_slices_per_pass": flood_slices,
        "hostile_pass_done_s": hostile_seconds,
        "hostile_storage_status": status,
    }


# ------------------------------------------------------------------ bench side


def flood(s3: Any, bucket: str, *, prefix: str, count: int, threads: int) -> float:
    """``count`` tiny objects under ``prefix`` (100 per step folder), concurrently;
    the seconds it took."""
    started = time.monotonic()

    def put(i: int) -> None:
        s3.put_object(Bucket=bucket, Key=f"{prefix}step-{i // 100:09d}/junk-{i:06d}", Body=b"x")

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(put, range(count)):
            pass
    return time.monotonic() - started


def flood_marker(count: int) -> str:
    """The object ``--keep-flood`` writes once ``count`` flood objects are all there
    (outside the flooded prefix)."""
    return f"complete-{count}"


def flood_kept(s3: Any, *, count: int) -> bool:
    """Whether the kept bucket holds a complete flood of ``count`` objects; if so its
    owner record (a job of an earlier run) is removed, so the new job claims it."""
    try:
        s3.head_object(Bucket=FLOOD_BUCKET, Key=flood_marker(count))
    except s3.exceptions.ClientError:
        return False
    s3.delete_object(Bucket=FLOOD_BUCKET, Key=f"runs/{FLOOD}/.cairn/owner.json")
    return True


def drop_bucket(s3: Any, bucket: str, *, threads: int) -> None:
    """Delete every object (batches of 1,000, concurrently), then the bucket."""
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    batches = [
        [{"Key": o["Key"]} for o in page.get("Contents", [])]
        for page in pages
        if page.get("Contents")
    ]

    def delete(batch: list[dict[str, str]]) -> None:
        s3.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(delete, batches):
            pass
    s3.delete_bucket(Bucket=bucket)


def chart_memory_limit_mib() -> int:
    """``resources.limits.memory`` of the chart's values (``<N>Mi``)."""
    import yaml

    values = yaml.safe_load(CHART_VALUES.read_text())
    limit = str(values["resources"]["limits"]["memory"])
    if not limit.endswith("Mi"):
        raise ValueError(f"chart memory limit {limit!r} is not in Mi")
    return int(limit.removesuffix("Mi"))


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[int(q * (len(ordered) - 1))], 3)


def summary(seen: dict[str, Any], *, limit_mib: int) -> dict[str, Any]:
    alone, beside = seen["alone"], seen["beside"]
    peak = max(seen["vm_hwm_kib"], seen["rss_sampled_peak_kib"]) / 1024
    return {
        "first_pass_alone_p50_s": quantile(alone, 0.5),
        "first_pass_alone_p95_s": quantile(alone, 0.95),
        "first_pass_alone_mean_s": round(statistics.mean(alone), 3),
        "first_pass_beside_hostile_p50_s": quantile(beside, 0.5),
        "first_pass_beside_hostile_p95_s": quantile(beside, 0.95),
        "first_pass_beside_hostile_mean_s": round(statistics.mean(beside), 3),
        "ratio_beside_over_alone_mean": round(statistics.mean(beside) / statistics.mean(alone), 3),
        "ratio_beside_over_alone_p95": round(quantile(beside, 0.95) / quantile(alone, 0.95), 3),
        "operator_rss_idle_mib": round(seen["rss_idle_kib"] / 1024, 1),
        "operator_rss_peak_mib": round(peak, 1),
        "chart_memory_limit_mib": limit_mib,
        "rss_peak_under_limit": peak < limit_mib,
        "flood_keys_listed_per_pass": seen["flood_keys_listed_per_pass"],
        "flood_slices_per_pass": seen["flood_slices_per_pass"],
        "hostile_pass_done_s": seen["hostile_pass_done_s"],
        "hostile_storage_status": seen["hostile_storage_status"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--steps", type=int, default=2, help="committed steps per healthy job")
    parser.add_argument("--objects", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--put-threads", type=int, default=32)
    parser.add_argument("--pass-deadline", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--threads", type=int, default=None, help="S3 threads (default: the operator's)"
    )
    parser.add_argument(
        "--keep-flood",
        action="store_true",
        help=f"flood in bucket {FLOOD_BUCKET}, kept; reused when complete",
    )
    parser.add_argument("--operator", help=argparse.SUPPRESS)  # the child: a JSON spec
    args = parser.parse_args(argv)
    if args.operator:
        print(json.dumps(operator_side(json.loads(args.operator))))
        return 0
    return bench(args)


def bench(args: argparse.Namespace) -> int:
    import boto3
    import botocore.config
    import record  # bench/, next to this script

    from cairn.devcluster import cluster
    from cairn.operator.core import tunables
    from tests.conftest import DevclusterHandle
    from tests.integration.devcluster import kube_helpers as kh
    from tests.integration.storage import test_tenant_caps as caps
    from tests.integration.storage.test_storage_operator import write_step

    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    env = record.environment()
    target = cluster.Cluster.default()
    handle = DevclusterHandle(kubeconfig=target.state.admin_kubeconfig, target=target)
    creds = handle.s3_credentials
    s3 = boto3.client(
        "s3",
        endpoint_url=handle.s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id=creds.access_key,
        aws_secret_access_key=creds.secret_key,
        config=botocore.config.Config(
            max_pool_connections=args.put_threads * 2, s3={"addressing_style": "path"}
        ),
    )
    timings: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        tmp = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory()))
        spaces = [
            stack.enter_context(contextlib.contextmanager(kh.temp_namespace)(handle.core, prefix=p))
            for p in ("scale-ok", "scale-bad")
        ]
        good = caps.Tenant(handle, spaces[0], tmp / "good")
        stack.callback(drop_bucket, s3, good.bucket, threads=args.put_threads)
        bad = caps.Tenant(handle, spaces[1], tmp / "bad")
        stack.callback(drop_bucket, s3, bad.bucket, threads=args.put_threads)
        started = time.monotonic()
        names = [f"ok-{i}" for i in range(args.jobs)]
        rng.shuffle(names)  # creation order, and so the loop's order, from the seed

        def healthy(name: str) -> None:
            made = good.create(name)
            for n in range(1, args.steps + 1):
                write_step(good.opts(name), tmp / name, 10 * n, job_uid=made["metadata"]["uid"])

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for _ in pool.map(healthy, names):
                pass
        timings["healthy_setup_s"] = round(time.monotonic() - started, 1)
        big = bad.create(BIG)
        write_step(bad.opts(BIG), tmp / BIG, 10, job_uid=big["metadata"]["uid"])
        flooded = bad
        if args.keep_flood:
            flooded = copy.copy(bad)  # the same namespace and Secret, the kept bucket
            flooded.bucket = FLOOD_BUCKET
        flooded.create(FLOOD)
        huge = caps.huge_manifest(step=20, size=16 * MiB)
        s3.put_object(Bucket=bad.bucket, Key=f"runs/{BIG}/step-000000020/manifest.json", Body=huge)
        reused = args.keep_flood and flood_kept(s3, count=args.objects)
        if not reused:
            if args.keep_flood:
                with contextlib.suppress(s3.exceptions.ClientError):
                    s3.create_bucket(Bucket=FLOOD_BUCKET)
            key = f"runs/{FLOOD}/step-000000020/manifest.json"
            s3.put_object(Bucket=flooded.bucket, Key=key, Body=huge)
            timings["flood_put_s"] = round(
                flood(
                    s3,
                    flooded.bucket,
                    prefix=f"runs/{FLOOD}/",
                    count=args.objects,
                    threads=args.put_threads,
                ),
                1,
            )
            timings["flood_puts_per_s"] = round(args.objects / timings["flood_put_s"])
            if args.keep_flood:
                s3.put_object(Bucket=FLOOD_BUCKET, Key=flood_marker(args.objects), Body=b"")
        del huge
        print(f"set up: {timings}", flush=True)
        with caps.hung_store() as endpoint:
            bad.create(HUNG, endpoint=endpoint)
            spec = {
                "kubeconfig": str(handle.kubeconfig),
                "healthy_ns": spaces[0],
                "hostile_ns": spaces[1],
                "rounds": args.rounds,
                "pass_deadline": args.pass_deadline,
                "threads": args.threads or tunables.DEFAULT.storage.threads,
            }
            child_env = dict(
                os.environ,
                CAIRN_S3_ENDPOINT_ALLOWLIST=f"{handle.s3_endpoint},{endpoint}",
            )
            started = time.monotonic()
            done = subprocess.run(
                [sys.executable, __file__, "--operator", json.dumps(spec)],
                capture_output=True,
                text=True,
                timeout=3000,
                env=child_env,
                check=False,
            )
            timings["operator_rounds_s"] = round(time.monotonic() - started, 1)
        if done.returncode != 0:
            print(done.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"operator side failed ({done.returncode})")
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        cleanup_started = time.monotonic()
    timings["cleanup_s"] = round(time.monotonic() - cleanup_started, 1)

    figures = {**summary(seen, limit_mib=chart_memory_limit_mib()), "timings": timings}
    params = {
        "healthy_jobs": args.jobs,
        "steps_per_healthy_job": args.steps,
        "hostile_objects": args.objects,
        "hostile_manifest_bytes": 16 * MiB,
        "hostile_jobs": [FLOOD, BIG, HUNG],
        "rounds": args.rounds,
        "seed": seed,
        "threads": args.threads or tunables.DEFAULT.storage.threads,
        "list_pages_per_pass": tunables.DEFAULT.s3.list_pages_per_pass,
        "flood_bucket": FLOOD_BUCKET if args.keep_flood else "the hostile tenant's (dropped)",
        "flood_reused": reused,
        "pass_deadline_seconds": args.pass_deadline,
        "slow_after_seconds": tunables.DEFAULT.storage.slow_after_seconds,
        "manifest_max_bytes": tunables.DEFAULT.s3.manifest_max_bytes,
        "list_max_keys": tunables.DEFAULT.s3.list_max_keys,
        "operator": "bench/tenant_scale.py --operator: runtime.Runtime's S3 loop, no kopf",
    }
    path = record.write(
        bench="tenant-scale", tag=str(args.jobs), env=env, params=params, figures=figures
    )
    print(json.dumps(figures, indent=2))
    print(f"recorded in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
