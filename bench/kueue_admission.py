"""Kueue on the devcluster: admission and preemption latency, start time.

Measures, with the devcluster's real Kueue (started if not running) and a
ClusterQueue of the bench's own (1 cpu) in a fresh namespace:

- admission: `--samples` times, a Workload within quota is created and the
  seconds from the create call (through Kueue's webhooks) to the watch event carrying
  `Admitted=True` are taken; the Workload is deleted before the next one
  (p50, max);
- preemption: a priority-0 Workload takes the whole quota, then a
  priority-100 one is created; the seconds until the low one carries
  `Evicted=True` (reason Preempted), `--samples` times;
- `--restart`: Kueue is stopped by PID and started again (`kueue.up`),
  its `ready_seconds` reported. This interrupts Kueue's webhooks for the
  shared devcluster for those seconds: only with `--restart`.

Usage (devcluster up): python -m bench.kueue_admission [--samples 20] [--restart]
Not part of the test suite.
"""

import argparse
import functools
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

from kubernetes import client, config, watch

from cairn.devcluster import cluster, kueue

GROUP, VERSION = kueue.API_GROUP, "v1beta2"
TIMEOUT_SECONDS = 60


def _workload(name: str, *, cpu: str, priority: int) -> dict[str, Any]:
    requests = {"cpu": cpu}
    return kueue.workload(name, queue=kueue.LOCAL_QUEUE, priority=priority, requests=requests)


def _has(obj: dict[str, Any], kind: str) -> bool:
    return any(
        c["type"] == kind and c["status"] == "True"
        for c in obj.get("status", {}).get("conditions", [])
    )


def _timed_until(
    api: client.CustomObjectsApi,
    namespace: str,
    name: str,
    kind: str,
    action: Callable[[], None],
) -> float:
    """Seconds from calling `action()` to a watch event showing `name` with `kind`=True."""
    listed = api.list_namespaced_custom_object(GROUP, VERSION, namespace, "workloads")
    if any(o["metadata"]["name"] == name and _has(o, kind) for o in listed["items"]):
        action()
        return 0.0
    stream = watch.Watch()
    events = stream.stream(
        api.list_namespaced_custom_object,
        GROUP,
        VERSION,
        namespace,
        "workloads",
        resource_version=listed["metadata"]["resourceVersion"],
        field_selector=f"metadata.name={name}",
        timeout_seconds=TIMEOUT_SECONDS,
    )
    started = time.monotonic()
    action()
    try:
        for event in events:
            if _has(event["object"], kind):
                return time.monotonic() - started
    finally:
        stream.stop()
    raise RuntimeError(f"no {kind}=True on {namespace}/{name} within {TIMEOUT_SECONDS}s")


def _delete(api: client.CustomObjectsApi, namespace: str, name: str) -> None:
    api.delete_namespaced_custom_object(GROUP, VERSION, namespace, "workloads", name)


def _create(api: client.CustomObjectsApi, namespace: str, body: dict[str, Any]) -> None:
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, "workloads", body)


def _release(api: client.CustomObjectsApi, namespace: str, name: str) -> None:
    """The owner's part after eviction: the Workload goes, and its quota with it."""
    _delete(api, namespace, name)


def measure(target: cluster.Cluster, samples: int) -> dict[str, list[float]]:
    api_client = config.new_client_from_config(config_file=str(target.state.admin_kubeconfig))
    api = client.CustomObjectsApi(api_client)
    core = client.CoreV1Api(api_client)
    namespace = f"kbench-{uuid.uuid4().hex[:6]}"
    cq = f"cq-{namespace}"
    core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
    kueue.ensure_queues(target, namespace=namespace, quota={"cpu": "1"}, cluster_queue_name=cq)
    out: dict[str, list[float]] = {"admission": [], "preemption": []}
    try:
        for i in range(samples):
            name = f"a{i}"
            body = _workload(name, cpu="500m", priority=0)
            out["admission"].append(
                _timed_until(
                    api,
                    namespace,
                    name,
                    "Admitted",
                    functools.partial(_create, api, namespace, body),
                )
            )
            _delete(api, namespace, name)
        for i in range(samples):
            low, high = f"low{i}", f"high{i}"
            low_body = _workload(low, cpu="1", priority=0)
            _timed_until(
                api,
                namespace,
                low,
                "Admitted",
                functools.partial(_create, api, namespace, low_body),
            )
            high_body = _workload(high, cpu="1", priority=100)
            out["preemption"].append(
                _timed_until(
                    api,
                    namespace,
                    low,
                    "Evicted",
                    functools.partial(_create, api, namespace, high_body),
                )
            )
            _release(api, namespace, low)
            _timed_until(api, namespace, high, "Admitted", lambda: None)
            _delete(api, namespace, high)
    finally:
        core.delete_namespace(namespace)
        api.delete_cluster_custom_object(GROUP, VERSION, "clusterqueues", cq)
        api_client.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--restart", action="store_true")
    args = parser.parse_args()
    target = cluster.Cluster.default()
    if args.restart:
        kueue.down(target)
    report = kueue.up(target)
    print(f"kueue: already running={report.already_running} ready in {report.ready_seconds:.2f}s")
    for what, seconds in measure(target, args.samples).items():
        ms = sorted(s * 1000 for s in seconds)
        print(
            f"{what}: n={len(ms)} p50={statistics.median(ms):.0f} ms max={ms[-1]:.0f} ms "
            f"min={ms[0]:.0f} ms"
        )


if __name__ == "__main__":
    main()
