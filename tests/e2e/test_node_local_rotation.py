"""End to end: node-local volumes are rotated on EVERY pod, not only rank 0's.

Covers, with the real operator, real pods (the node agent), the reference
FSDP2 trainer and the real S3 server: the quickstart job (2 pods, one
emptyDir volume each, keepLast 2) saving 10 times leaves at most 2 committed
steps on every pod's volume, each holding the manifest and that pod's own
files, and no temporary step folders; the last step was uploaded.
"""

import uuid
from typing import Any

import pytest
from kubernetes import client

from cairn.api import manifest, trainingjob
from tests import demo

pytestmark = [pytest.mark.e2e, pytest.mark.cluster]

STEPS = 20
INTERVAL = 2  # 10 saves
KEEP_LAST = 2


def test_node_local_keep_last_two_on_every_pod(devcluster: Any, operator: Any) -> None:
    namespace = f"e2e-{uuid.uuid4().hex[:8]}"
    bucket = f"e2e-{uuid.uuid4().hex[:10]}"
    target = devcluster.target
    demo.prepare_namespace(
        api_client=devcluster.api_client, target=target, namespace=namespace, bucket=bucket
    )
    body = demo.quickstart_manifest(target, name="rotation")
    spec = body["spec"]
    args = spec["args"]
    args[args.index("--steps") + 1] = str(STEPS)
    spec["checkpoint"]["intervalSteps"] = INTERVAL
    spec["checkpoint"]["retention"]["local"]["keepLast"] = KEEP_LAST
    spec["checkpoint"]["upload"]["uri"] = f"s3://{bucket}/rotation"
    assert "emptyDir" in spec["checkpoint"]["volume"]
    rows: list[demo.Row] = []
    job = demo.run_job(
        api_client=devcluster.api_client,
        namespace=namespace,
        body=body,
        kill_rank_after_commit=None,
        on_row=rows.append,
        timeout=600,
    )
    status = job["status"]
    assert status["phase"] == "Succeeded", status
    assert status["checkpoints"]["lastCommitted"]["step"] == STEPS

    core = client.CoreV1Api(devcluster.api_client)
    pods = core.list_namespaced_pod(namespace, label_selector="cairn.dev/job-name=rotation")
    ranks = sorted(int(p.metadata.labels["cairn.dev/rank"]) for p in pods.items)
    assert ranks == [0, 1], "both pods are kept (cleanup policy Keep)"
    for pod in pods.items:
        rank = int(pod.metadata.labels["cairn.dev/rank"])
        (pod_dir,) = (devcluster.state_dir / "pods").glob(f"{namespace}_{pod.metadata.name}_*")
        volume = pod_dir / "volumes" / trainingjob.CHECKPOINT_VOLUME_NAME
        folders = sorted(d.name for d in volume.glob("step-*"))
        committed = [d for d in folders if (volume / d / manifest.MANIFEST_NAME).exists()]
        assert 1 <= len(committed) <= KEEP_LAST, (rank, folders)
        assert committed[-1] == manifest.step_dir_name(STEPS), (rank, folders)
        assert not list(volume.glob(".step-*.tmp-*")), (rank, "temporary folders left")
        for name in committed:
            files = {p.name for p in (volume / name).iterdir() if p.name.startswith("__")}
            assert files and all(f.startswith(f"__{rank}_") for f in files), (rank, files)

    listing = demo.s3_listing(target, bucket=bucket, prefix="rotation")
    assert manifest.step_dir_name(STEPS) in listing
    core.delete_namespace(namespace)
