"""End to end: Kueue preempts a training job and no step is lost.

The real operator process, real Kueue v0.19.2 (the devcluster's), real pods
running the reference FSDP2 trainer (2 nodes each), the real S3 server. The
ClusterQueue has room for exactly one 2-node job (1 cpu, 1Gi: each pod asks
500m/512Mi):

1. an undisturbed reference run (not queued) exports its final weights;
2. a low-priority queued job runs and commits;
3. a high-priority queued job arrives: Kueue evicts the low one; the
   operator stops it the Cairn way (SIGTERM, final checkpoint at the next
   step boundary, committed and uploaded), and only once its pods are gone
   releases its quota — the test checks, at the first moment it sees the
   quota released, that the job's final step is committed, uploaded and its
   manifest is in S3;
4. the high job runs to Succeeded; the low one is admitted again, resumes
   from exactly its final checkpoint and ends with weights bit-identical to
   the reference run (zero lost steps).

Prints its measured numbers (eviction → quota released, steps lost) on a line
starting with ``E2E-NUMBERS`` and records them as junit properties.
"""

import json
import pathlib
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from cairn.api import manifest
from cairn.devcluster import kueue
from cairn.operator.core import kueueplan as protocol
from tests import demo
from tests.integration.operator import kueue_helpers as kq

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.timeout(1500)]

ONE_JOB = {"cpu": "1", "memory": "1Gi"}
OUT_CLAIM = "weights"
OUT_MOUNT = "/weights"
STEPS, INTERVAL, STEP_DELAY = 80, 10, 0.4
POLL_SECONDS = 0.2
BOUND_SECONDS = 900.0


@pytest.fixture
def space(devcluster: Any, operator: Any) -> Iterator[tuple[str, str]]:
    """A fresh namespace (LocalQueue, S3 Secret, a shared claim for the weights) and bucket."""
    namespace = f"e2e-kq-{uuid.uuid4().hex[:8]}"
    bucket = f"e2e-kq-{uuid.uuid4().hex[:8]}"
    demo.prepare_namespace(
        api_client=devcluster.api_client,
        target=devcluster.target,
        namespace=namespace,
        bucket=bucket,
    )
    kq.kueue_ready(devcluster.target)
    kq.ensure_priority_classes(devcluster.api_client)
    kueue.ensure_queues(devcluster.target, namespace=namespace, quota=ONE_JOB)
    core = client.CoreV1Api(devcluster.api_client)
    core.create_namespaced_persistent_volume_claim(
        namespace,
        client.V1PersistentVolumeClaim(
            metadata=client.V1ObjectMeta(name=OUT_CLAIM),
            spec=client.V1PersistentVolumeClaimSpec(
                access_modes=["ReadWriteMany"],
                resources=client.V1VolumeResourceRequirements(requests={"storage": "1Gi"}),
            ),
        ),
    )
    yield namespace, bucket
    kq.drain(devcluster.api_client, namespace)
    try:
        core.delete_namespace(namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise


def _body(devcluster: Any, *, name: str, bucket: str, steps: int) -> dict[str, Any]:
    body = demo.quickstart_manifest(devcluster.target, name=name)
    spec = body["spec"]
    args: list[str] = list(spec["args"])
    for flag, value in (("--steps", steps), ("--step-delay", STEP_DELAY)):
        if flag in args:
            args[args.index(flag) + 1] = str(value)
        else:
            args += [flag, str(value)]
    spec["args"] = [*args, "--export", f"{OUT_MOUNT}/{name}.safetensors"]
    spec["checkpoint"]["intervalSteps"] = INTERVAL
    spec["checkpoint"]["upload"]["uri"] = f"s3://{bucket}/{name}"
    spec["template"] = {
        "volumes": [{"name": "weights", "persistentVolumeClaim": {"claimName": OUT_CLAIM}}],
        "volumeMounts": [{"name": "weights", "mountPath": OUT_MOUNT}],
    }
    return body


def _out_dir(core: client.CoreV1Api, namespace: str) -> pathlib.Path:
    """The host directory behind the weights claim (the devcluster's local-path PV)."""
    pvc = demo.retrying(lambda: core.read_namespaced_persistent_volume_claim(OUT_CLAIM, namespace))
    pv = demo.retrying(lambda: core.read_persistent_volume(pvc.spec.volume_name))
    return pathlib.Path(pv.spec.host_path.path)


def _numbers(record_property: Callable[[str, object], None], **values: object) -> None:
    for key, value in values.items():
        record_property(key, value)
    print(f"E2E-NUMBERS {json.dumps(values, sort_keys=True)}", flush=True)


def _step(job: dict[str, Any], key: str) -> int | None:
    value = (((job.get("status") or {}).get("checkpoints") or {}).get(key) or {}).get("step")
    return None if value is None else int(value)


class Preemption:
    """Polls the low job, its Workload and the high job; records the moments that matter."""

    def __init__(self, devcluster: Any, namespace: str, bucket: str, high: dict[str, Any]) -> None:
        self.devcluster = devcluster
        self.namespace = namespace
        self.bucket = bucket
        self.high = high
        self.custom = client.CustomObjectsApi(devcluster.api_client)
        self.high_created = False
        self.evicted_at: float | None = None
        self.released_at: float | None = None
        self.at_release: dict[str, Any] | None = None
        self.s3_at_release: dict[str, list[str]] | None = None
        self.eviction_condition: dict[str, Any] | None = None
        self.release_condition: dict[str, Any] | None = None
        self.phases: list[str] = []
        self.live_pods_at_release: list[str] | None = None
        self.pods_gone_at: float | None = None

    def _live_pods(self) -> list[str]:
        pods = client.CoreV1Api(self.devcluster.api_client).list_namespaced_pod(
            self.namespace, label_selector="cairn.dev/job-name=low"
        )
        return [
            p.metadata.name for p in pods.items if p.status.phase not in ("Succeeded", "Failed")
        ]

    def poll(self, low: dict[str, Any]) -> None:
        phase = (low.get("status") or {}).get("phase", "")
        if not self.phases or self.phases[-1] != phase:
            self.phases.append(phase)
        if not self.high_created:
            if phase == "Running" and (_step(low, "lastUploaded") or 0) >= INTERVAL:
                self.custom.create_namespaced_custom_object(
                    demo.GROUP, demo.VERSION, self.namespace, demo.PLURAL, self.high
                )
                self.high_created = True
                demo.say(f"high-priority job created; low at step {_step(low, 'lastCommitted')}")
            return
        if self.released_at is not None:
            return
        raw = kq.workload(self.devcluster.api_client, self.namespace, "low")
        if self.evicted_at is None and kq.is_true(raw, protocol.EVICTED):
            self.evicted_at = time.monotonic()
            self.eviction_condition = kq.condition(raw, protocol.EVICTED)
            demo.say("low evicted by Kueue")
        if self.evicted_at is not None and self.pods_gone_at is None and not self._live_pods():
            self.pods_gone_at = time.monotonic()
        if self.evicted_at is not None and "admission" not in ((raw or {}).get("status") or {}):
            self.released_at = time.monotonic()
            self.release_condition = kq.condition(raw, protocol.QUOTA_RESERVED)
            # What had been saved at the moment the quota was given back.
            self.at_release = demo.get_job(self.custom, self.namespace, "low")
            self.s3_at_release = demo.s3_listing(
                self.devcluster.target, bucket=self.bucket, prefix="low"
            )
            self.live_pods_at_release = self._live_pods()
            demo.say("low's quota released")


def test_preempted_job_loses_no_step(
    devcluster: Any, space: tuple[str, str], record_property: Callable[[str, object], None]
) -> None:
    namespace, bucket = space
    core = client.CoreV1Api(devcluster.api_client)
    custom = client.CustomObjectsApi(devcluster.api_client)
    started = time.monotonic()

    reference = demo.run_job(
        api_client=devcluster.api_client,
        namespace=namespace,
        body=_body(devcluster, name="reference", bucket=bucket, steps=STEPS),
        kill_rank_after_commit=None,
        on_row=lambda row: print("    ref", row.line()),
        timeout=BOUND_SECONDS,
    )
    assert reference["status"]["phase"] == "Succeeded", reference["status"]

    low = kq.queued(_body(devcluster, name="low", bucket=bucket, steps=STEPS), priority=kq.LOW)
    high = kq.queued(_body(devcluster, name="high", bucket=bucket, steps=20), priority=kq.HIGH)
    watcher = Preemption(devcluster, namespace, bucket, high)
    final = demo.run_job(
        api_client=devcluster.api_client,
        namespace=namespace,
        body=low,
        kill_rank_after_commit=None,
        on_row=lambda row: print("    low", row.line()),
        on_poll=watcher.poll,
        poll_seconds=POLL_SECONDS,
        timeout=BOUND_SECONDS,
    )
    high_job = demo.get_job(custom, namespace, "high")
    status = final["status"]
    held = watcher.at_release
    assert held is not None and watcher.evicted_at is not None and watcher.released_at is not None
    saved = _step(held, "lastCommitted")
    resumed = status["checkpoints"]["resumedFrom"]
    steps_lost = (held["status"].get("step") or 0) - resumed["step"]
    listing = watcher.s3_at_release or {}
    _numbers(
        record_property,
        test="kueue_preemption",
        evicted_to_quota_released_seconds=round(watcher.released_at - watcher.evicted_at, 2),
        evicted_to_pods_gone_seconds=round((watcher.pods_gone_at or 0) - watcher.evicted_at, 2),
        pods_gone_to_quota_released_seconds=round(
            watcher.released_at - (watcher.pods_gone_at or watcher.released_at), 2
        ),
        eviction_time=(watcher.eviction_condition or {}).get("lastTransitionTime"),
        quota_released_time=(watcher.release_condition or {}).get("lastTransitionTime"),
        final_checkpoint_step=saved,
        uploaded_at_release=_step(held, "lastUploaded"),
        step_when_stopped=held["status"].get("step"),
        resumed_from=resumed,
        steps_lost=steps_lost,
        low_phases=watcher.phases,
        wall_seconds=round(time.monotonic() - started, 1),
    )

    # Before the quota went back: stopped at a step boundary, that step committed and uploaded.
    assert held["status"]["phase"] == "Suspended", held["status"]
    assert saved is not None and saved > INTERVAL and saved == held["status"].get("step")
    assert _step(held, "lastUploaded") == saved
    assert manifest.MANIFEST_NAME in listing.get(manifest.step_dir_name(saved), []), listing
    assert watcher.live_pods_at_release == []

    # The high job ran to the end; the low one resumed from exactly its final checkpoint.
    assert high_job["status"]["phase"] == "Succeeded", high_job["status"]
    assert status["phase"] == "Succeeded", status
    assert resumed["step"] == saved and steps_lost == 0
    assert status["attempt"] == 2 and (status.get("restarts") or 0) == 0
    assert _step(final, "lastCommitted") == STEPS
    out = _out_dir(core, namespace)
    assert (out / "low.safetensors").read_bytes() == (out / "reference.safetensors").read_bytes()
