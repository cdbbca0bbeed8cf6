"""The children of an attempt, as the operator creates them on a real API server.

Covers: after a TrainingJob is created, the operator creates its
ServiceAccount, a Role that may only get/patch this one job's status
(`resourceNames`), the RoleBinding, the headless Service, and one Pod per
node rank named `<job>-a1-n<rank>`, all owned by the job (controller owner
reference) and labelled with job, attempt and rank. Each pod carries the
rendezvous env (nnodes, node rank, rank 0's headless DNS name as master
address, port — and rank 1 really resolves that name), the attempt id, the
checkpoint dir, the S3 settings with credentials as `secretKeyRef` only (the
secret's values appear nowhere in the pod specs or the job), and
terminationGracePeriodSeconds = finalCheckpointGraceSeconds.
"""

import json
from typing import Any

import pytest
from kubernetes import client

from tests.integration.devcluster import kube_helpers as kh
from tests.integration.operator.conftest import WAIT, Kube, job_body

pytestmark = pytest.mark.cluster

ACCESS_KEY = "AKIAUNITTESTVALUE0001"
SECRET_KEY = "s3cr3t-never-in-a-pod-spec-0001"
GRACE = 45

# Rank 1 resolves rank 0's headless DNS name (retrying until the agent has
# published it) and prints what it found; both ranks then idle.
RESOLVE = """
import os, socket, time
if os.environ['CAIRN_NODE_RANK'] == '1':
    for _ in range(100):
        try:
            print('resolved', socket.gethostbyname(os.environ['MASTER_ADDR']), flush=True)
            break
        except OSError:
            time.sleep(0.2)
time.sleep(600)
"""


def _owner_ok(obj: Any, job: dict[str, Any]) -> None:
    (ref,) = obj.metadata.owner_references
    assert (ref.api_version, ref.kind, ref.name, ref.uid) == (
        "cairn.dev/v1alpha1",
        "TrainingJob",
        job["metadata"]["name"],
        job["metadata"]["uid"],
    )
    assert ref.controller is True
    assert ref.block_owner_deletion is True


def test_attempt_children(kube: Kube) -> None:
    ns = kube.namespace
    kube.core.create_namespaced_secret(
        ns,
        client.V1Secret(
            metadata=client.V1ObjectMeta(name="s3-creds"),
            string_data={"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY},
        ),
    )
    body = job_body(
        "kids",
        script=RESOLVE,
        checkpoint={
            "finalCheckpointGraceSeconds": GRACE,
            "upload": {
                "uri": "s3://cairn-test/kids",
                "endpoint": "http://127.0.0.1:8333",
                "region": "us-east-1",
                "credentialsSecretRef": {"name": "s3-creds"},
            },
        },
    )
    job = kube.create(body)
    kube.wait_phase("kids", "Running", attempt=1)
    pods = kube.wait_pods_running("kids", attempt=1, count=2)

    sa = kube.core.read_namespaced_service_account("kids-trainer", ns)
    _owner_ok(sa, job)
    role = kube.rbac.read_namespaced_role("kids-status-writer", ns)
    _owner_ok(role, job)
    assert kube.api_client.sanitize_for_serialization(role.rules) == [
        {
            "apiGroups": ["cairn.dev"],
            "resources": ["trainingjobs/status"],
            "resourceNames": ["kids"],
            "verbs": ["get", "patch"],
        }
    ]
    binding = kube.rbac.read_namespaced_role_binding("kids-status-writer", ns)
    _owner_ok(binding, job)
    assert (binding.role_ref.kind, binding.role_ref.name) == ("Role", "kids-status-writer")
    assert [(s.kind, s.name, s.namespace) for s in binding.subjects] == [
        ("ServiceAccount", "kids-trainer", ns)
    ]
    service = kube.core.read_namespaced_service("kids", ns)
    _owner_ok(service, job)
    assert service.spec.cluster_ip == "None"
    assert service.spec.publish_not_ready_addresses is True
    assert service.spec.selector == {"cairn.dev/job-name": "kids"}
    assert [p.port for p in service.spec.ports] == [29500]

    assert [p.metadata.name for p in pods] == ["kids-a1-n0", "kids-a1-n1"]
    master = f"kids-a1-n0.kids.{ns}.svc.cluster.local"
    for rank, pod in enumerate(pods):
        _owner_ok(pod, job)
        assert pod.metadata.labels == {
            "cairn.dev/job-name": "kids",
            "cairn.dev/attempt": "1",
            "cairn.dev/rank": str(rank),
            "app.kubernetes.io/managed-by": "cairn",
        }
        spec = pod.spec
        assert spec.restart_policy == "Never"
        assert spec.service_account_name == "kids-trainer"
        assert (spec.hostname, spec.subdomain) == (f"kids-a1-n{rank}", "kids")
        assert spec.termination_grace_period_seconds == GRACE
        (container,) = spec.containers
        assert container.command == body["spec"]["command"]
        env = {e.name: e for e in container.env}
        values = {name: e.value for name, e in env.items() if e.value_from is None}
        expected = {
            "CAIRN_JOB_NAME": "kids",
            "CAIRN_ATTEMPT": "1",
            "CAIRN_NNODES": "2",
            "CAIRN_NODE_RANK": str(rank),
            "CAIRN_MASTER_ADDR": master,
            "CAIRN_MASTER_PORT": "29500",
            "PET_NNODES": "2",
            "PET_NODE_RANK": str(rank),
            "PET_MASTER_ADDR": master,
            "PET_MASTER_PORT": "29500",
            "MASTER_ADDR": master,
            "MASTER_PORT": "29500",
            "WORLD_SIZE": "2",
            "RANK": str(rank),
            "CAIRN_CHECKPOINT_DIR": "/checkpoints",
            "CAIRN_FINAL_CHECKPOINT_GRACE_SECONDS": str(GRACE),
            "CAIRN_UPLOAD_URI": "s3://cairn-test/kids",
            "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:8333",
            "AWS_REGION": "us-east-1",
            "CAIRN_REPORT_STATUS": "1" if rank == 0 else "0",
        }
        assert {k: values.get(k) for k in expected} == expected
        for name, key in (
            ("AWS_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID"),
            ("AWS_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY"),
        ):
            assert env[name].value is None
            ref = env[name].value_from.secret_key_ref
            assert (ref.name, ref.key) == ("s3-creds", key)
        mounts = {m.name: m.mount_path for m in container.volume_mounts}
        assert mounts["cairn-checkpoints"] == "/checkpoints"

    # No secret value anywhere in what the operator wrote or reported.
    everything = json.dumps(
        [kube.api_client.sanitize_for_serialization(p) for p in kube.pods("kids")]
        + [kube.job("kids")]
    )
    assert ACCESS_KEY not in everything
    assert SECRET_KEY not in everything

    # The rendezvous address works: rank 1 resolved rank 0's DNS name to its IP.
    rank0_ip = pods[0].status.pod_ip
    kh.wait_for(
        lambda: f"resolved {rank0_ip}" in kh.pod_log(kube.core, "kids-a1-n1", ns),
        timeout=WAIT,
        what="rank 1 resolving rank 0's headless DNS name",
    )
