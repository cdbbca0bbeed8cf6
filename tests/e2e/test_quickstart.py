"""End to end: the quickstart job on the devcluster, through a killed rank.

Covers, with the real operator process, real pods (the node agent), the
reference FSDP2 trainer and the real S3 server, in a namespace that enforces
the restricted Pod Security Standard: `examples/quickstart.yaml` reaches Succeeded after rank 1 is SIGKILLed mid-run; the gang restarted once
(`restarts` = 1) and attempt 2 resumed from a committed step (status
`resumedFrom`), never from a partial; status shows lastCommitted and
lastUploaded at the final step; once the operator's S3 pass has settled
(it runs beside the lifecycle and may still be rotating a step at
Succeeded), the step folders in S3 are exactly ``status.storage.remoteSteps``
and each has a manifest whose files' sizes and CRC32C checksums verify; node-local folders keep at most
`keepLast` committed steps.
"""

import pathlib
import uuid
from typing import Any

import pytest
from kubernetes import client

from cairn.api import manifest, trainingjob
from tests import demo

pytestmark = [pytest.mark.e2e, pytest.mark.cluster]

FINAL_STEP = 40
KEEP_LAST = 2


def test_quickstart_survives_a_killed_rank(devcluster: Any, operator: Any) -> None:
    namespace = f"e2e-{uuid.uuid4().hex[:8]}"
    bucket = f"e2e-{uuid.uuid4().hex[:10]}"
    target = devcluster.target
    demo.prepare_namespace(
        api_client=devcluster.api_client, target=target, namespace=namespace, bucket=bucket
    )
    core = client.CoreV1Api(devcluster.api_client)
    labels = core.read_namespace(namespace).metadata.labels
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    body = demo.quickstart_manifest(target, name="quickstart")
    body["spec"]["checkpoint"]["upload"]["uri"] = f"s3://{bucket}/quickstart"
    rows: list[demo.Row] = []
    job = demo.run_job(
        api_client=devcluster.api_client,
        namespace=namespace,
        body=body,
        kill_rank_after_commit=10,
        on_row=rows.append,
        timeout=600,
    )

    status = job["status"]
    ckpts = status["checkpoints"]
    assert status["phase"] == "Succeeded", status
    assert status["restarts"] == 1
    assert status["attempt"] == 2
    assert ckpts["lastCommitted"]["step"] == FINAL_STEP
    assert ckpts["lastUploaded"]["step"] == FINAL_STEP
    resumed = ckpts["resumedFrom"]["step"]
    assert 10 <= resumed < FINAL_STEP and resumed % 5 == 0
    assert any(r.phase == "Restarting" for r in rows)

    demo.assert_s3_steps_verify(
        custom=client.CustomObjectsApi(devcluster.api_client),
        target=target,
        namespace=namespace,
        name="quickstart",
        bucket=bucket,
        prefix="quickstart",
        final_step=FINAL_STEP,
    )

    pods = core.list_namespaced_pod(namespace, label_selector="cairn.dev/job-name=quickstart")
    rank0 = [p for p in pods.items if p.metadata.labels["cairn.dev/rank"] == "0"]
    assert rank0, "the finished pods are kept (cleanup policy Keep)"
    for pod in rank0:
        (pod_dir,) = (devcluster.state_dir / "pods").glob(f"{namespace}_{pod.metadata.name}_*")
        ckpt_dir = pod_dir / "volumes" / trainingjob.CHECKPOINT_VOLUME_NAME
        committed = [d for d in ckpt_dir.glob("step-*") if (d / manifest.MANIFEST_NAME).exists()]
        assert 1 <= len(committed) <= KEEP_LAST, sorted(p.name for p in committed)
    core.delete_namespace(namespace)


def test_examples_dir_is_applied(devcluster: Any) -> None:
    """Every TrainingJob example passes the real API server's validation (dry run)."""
    demo.install_crd(devcluster.api_client)
    custom = client.CustomObjectsApi(devcluster.api_client)
    import yaml

    examples = pathlib.Path(demo.REPO / "examples")
    checked = 0
    for path in sorted(examples.glob("*.yaml")):
        body = yaml.safe_load(path.read_text())
        if body.get("kind") != "TrainingJob":
            continue
        custom.create_namespaced_custom_object(
            demo.GROUP, demo.VERSION, "default", demo.PLURAL, body, dry_run="All"
        )
        checked += 1
    assert checked >= 3
