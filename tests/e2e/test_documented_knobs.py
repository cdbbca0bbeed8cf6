"""End to end: checkpoint knobs docs/api.md documents, through the operator and real pods.

Two jobs run side by side in one namespace (one test: they share the cluster,
the operator and the wait), with the real operator, the node agent, the
reference FSDP2 trainer and the real S3 server:

- `knobs`: `procsPerNode: 2` in ONE pod (torchrun starts both ranks there;
  every committed step holds both ranks' files and a manifest of world size
  2); `intervalSeconds: 3` and no `intervalSteps` (saves come from rank 0's
  clock: at least two before the final one, consecutive manifests' commit
  times at least the interval apart less a second of slack for the write);
  `volume.emptyDir {medium: Memory, sizeLimit: 64Mi}` (the volume is a tmpfs
  of that size in the pod, as the kubelet makes it, and it is unmounted once
  the pod is deleted); `retention.local.maxBytes: 1` beside `keepLast: 5`
  (the byte budget, not the count, rotates: only the newest committed step
  stays on the volume, while every save is in S3).
- `stale`: no interval at all and `staleAfterSeconds: 5`: `CheckpointStale`
  turns True while it is Running (reason, message naming the seconds).
- `no-launcher`: `procsPerNode: 2` with `python -m ...` instead of torchrun
  (one process taking itself for rank 0 of 2 used to wait forever for a rank
  nobody starts): Failed with `ConfigurationError`, the message saying to use
  torchrun, without a restart spent.
"""

from __future__ import annotations

import itertools
import pathlib
import time
from typing import Any

import pytest
from kubernetes import client

from cairn.api import exitcodes, manifest, trainingjob
from tests import demo

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.timeout(600)]

STEPS = 50
INTERVAL_SECONDS = 3
INTERVAL_SLACK_SECONDS = 1.0
SIZE_LIMIT = "64Mi"
SIZE_LIMIT_KIB = 64 * 1024
STALE_AFTER_SECONDS = 5
TIMEOUT_SECONDS = 420.0
POLL_SECONDS = 1.0


def _knobs_manifest(target: Any, *, bucket: str) -> dict[str, Any]:
    body = demo.quickstart_manifest(target, name="knobs")
    spec = body["spec"]
    spec["nodes"], spec["procsPerNode"] = 1, 2
    spec["command"] = ["torchrun", "-m", "cairn.trainer.reference"]
    args = spec["args"]
    args[args.index("--steps") + 1] = str(STEPS)
    ckpt = spec["checkpoint"]
    ckpt.pop("intervalSteps")
    ckpt["intervalSeconds"] = INTERVAL_SECONDS
    ckpt["volume"] = {"emptyDir": {"medium": "Memory", "sizeLimit": SIZE_LIMIT}}
    ckpt["retention"] = {"local": {"keepLast": 5, "maxBytes": 1}}  # no remote rotation
    ckpt["upload"]["uri"] = f"s3://{bucket}/knobs"
    return body


def _stale_manifest(target: Any, *, bucket: str) -> dict[str, Any]:
    body = demo.quickstart_manifest(target, name="stale")
    spec = body["spec"]
    spec["nodes"] = 1
    args = spec["args"]
    args[args.index("--steps") + 1] = "2000"  # outlives the check; deleted with the namespace
    ckpt = spec["checkpoint"]
    ckpt.pop("intervalSteps")
    ckpt["staleAfterSeconds"] = STALE_AFTER_SECONDS
    ckpt["upload"]["uri"] = f"s3://{bucket}/stale"
    return body


def _no_launcher_manifest(target: Any, *, bucket: str) -> dict[str, Any]:
    body = demo.quickstart_manifest(target, name="no-launcher")
    spec = body["spec"]
    spec["nodes"], spec["procsPerNode"] = 1, 2
    assert spec["command"][0] == "python"
    spec["checkpoint"]["upload"]["uri"] = f"s3://{bucket}/no-launcher"
    return body


def _condition(job: dict[str, Any], kind: str) -> dict[str, Any] | None:
    found = [c for c in (job.get("status") or {}).get("conditions") or [] if c["type"] == kind]
    return found[0] if found else None


def _mount(path: pathlib.Path) -> tuple[str, str] | None:
    """(fstype, options) of the mount AT `path`, from /proc/self/mounts."""
    with open("/proc/self/mounts", encoding="utf-8") as mounts:
        for line in mounts:
            _, point, fstype, options, *_ = line.split()
            if point == str(path.resolve()):
                return fstype, options
    return None


def _follow(
    custom: client.CustomObjectsApi, namespace: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """Poll until `knobs` and `no-launcher` end and `stale` went stale: the two
    ended jobs and the stale job's CheckpointStale condition as first seen True."""
    stale_seen: dict[str, Any] | None = None
    knobs: dict[str, Any] = {}
    stale: dict[str, Any] = {}
    no_launcher: dict[str, Any] = {}
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        knobs = demo.get_job(custom, namespace, "knobs")
        no_launcher = demo.get_job(custom, namespace, "no-launcher")
        ended = (no_launcher.get("status") or {}).get("phase") in ("Succeeded", "Failed")
        if stale_seen is None:
            stale = demo.get_job(custom, namespace, "stale")
            cond = _condition(stale, "CheckpointStale")
            running = (stale.get("status") or {}).get("phase") == "Running"
            if cond is not None and cond["status"] == "True" and running:
                stale_seen = cond
        phase = (knobs.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed") and stale_seen is not None and ended:
            return knobs, stale_seen, no_launcher
        time.sleep(POLL_SECONDS)
    raise AssertionError(
        f"knobs did not end, or stale never went stale, in {TIMEOUT_SECONDS} s: "
        f"knobs {knobs.get('status')}; stale {stale.get('status')}; "
        f"no-launcher {no_launcher.get('status')}"
    )


def test_procs_per_node_interval_seconds_memory_volume_max_bytes_staleness_no_launcher(
    devcluster: Any, space: tuple[str, str]
) -> None:
    namespace, bucket = space
    target = devcluster.target
    custom = client.CustomObjectsApi(devcluster.api_client)
    core = client.CoreV1Api(devcluster.api_client)
    bodies = (
        _knobs_manifest(target, bucket=bucket),
        _stale_manifest(target, bucket=bucket),
        _no_launcher_manifest(target, bucket=bucket),
    )
    for body in bodies:
        custom.create_namespaced_custom_object(
            demo.GROUP, demo.VERSION, namespace, demo.PLURAL, body
        )
    knobs, stale, no_launcher = _follow(custom, namespace)

    # procsPerNode 2 without a launcher: refused at start-up, nothing retried.
    failed = no_launcher["status"]
    assert failed["phase"] == "Failed", failed
    assert int(failed.get("restarts") or 0) == 0, failed
    reasons = {c["type"]: c for c in failed.get("conditions") or []}
    message = str(failed.get("lastFailure")) + str(reasons.get("Failed"))
    assert exitcodes.CONFIG_ERROR_REASON in message, failed
    assert "torchrun -m your.module" in message, failed

    status = knobs["status"]
    assert status["phase"] == "Succeeded", status.get("lastFailure")
    assert status["checkpoints"]["lastCommitted"]["step"] == STEPS
    assert status["checkpoints"]["lastUploaded"]["step"] == STEPS

    # procsPerNode: one pod carries both ranks.
    (pod,) = core.list_namespaced_pod(namespace, label_selector="cairn.dev/job-name=knobs").items
    (pod_dir,) = (devcluster.state_dir / "pods").glob(f"{namespace}_{pod.metadata.name}_*")
    volume = pod_dir / "volumes" / trainingjob.CHECKPOINT_VOLUME_NAME

    # medium Memory: a tmpfs of sizeLimit, as the kubelet mounts it.
    mounted = _mount(volume)
    assert mounted is not None, f"{volume} is not a mount point"
    fstype, options = mounted
    assert fstype == "tmpfs", mounted
    assert f"size={SIZE_LIMIT_KIB}k" in options.split(","), mounted

    # maxBytes 1 beside keepLast 5: only the newest committed step stays.
    committed = sorted(
        d.name for d in volume.glob("step-*") if (d / manifest.MANIFEST_NAME).exists()
    )
    assert committed == [manifest.step_dir_name(STEPS)], committed
    files = {p.name for p in (volume / committed[0]).iterdir() if p.name.startswith("__")}
    assert any(f.startswith("__0_") for f in files), files
    assert any(f.startswith("__1_") for f in files), files

    # intervalSeconds: every save is in S3 (no remote rotation); rank 0's clock paced them.
    s3 = target.s3_client()
    docs = []
    for folder in sorted(demo.s3_listing(target, bucket=bucket, prefix="knobs")):
        key = f"knobs/{folder}/{manifest.MANIFEST_NAME}"
        docs.append(manifest.parse_manifest(s3.get_object(Bucket=bucket, Key=key)["Body"].read()))
    docs.sort(key=lambda d: d.step)
    assert {d.world_size for d in docs} == {2}, [d.world_size for d in docs]
    periodic = [d for d in docs if d.step != STEPS]
    assert len(periodic) >= 2, [d.step for d in docs]
    gaps = [b.created_at - a.created_at for a, b in itertools.pairwise(periodic)]
    assert all(g >= INTERVAL_SECONDS - INTERVAL_SLACK_SECONDS for g in gaps), (
        [d.step for d in periodic],
        gaps,
    )

    # staleAfterSeconds: stale while Running, and the condition says why.
    assert stale.get("reason"), stale
    assert f"{STALE_AFTER_SECONDS}" in (stale.get("message") or ""), stale

    # The memory-backed volume ends with its pod.
    core.delete_namespaced_pod(pod.metadata.name, namespace)
    deadline = time.monotonic() + 120
    while _mount(volume) is not None:
        assert time.monotonic() < deadline, f"{volume} still mounted after its pod was deleted"
        time.sleep(POLL_SECONDS)
