"""Pure child builders, compared as whole objects.

Covers: the per-job ServiceAccount, the Role limited to this job's status,
its RoleBinding, the headless Service, and a rank's Pod with the torchrun env,
checkpoint volume, secretKeyRef credentials (never copied values), overlay and
user env; deterministic names.
"""

from typing import Any

from cairn.api import exitcodes, podenv
from cairn.operator.core import builders, names

from . import jobs

OWNER = {
    "apiVersion": "cairn.dev/v1alpha1",
    "kind": "TrainingJob",
    "name": "demo",
    "uid": "uid-1",
    "controller": True,
    "blockOwnerDeletion": True,
}
OWNED_LABELS = {"cairn.dev/job-name": "demo", "app.kubernetes.io/managed-by": "cairn"}


def _meta(name: str, labels: dict[str, str] = OWNED_LABELS) -> dict[str, Any]:
    return {"name": name, "namespace": "ml", "labels": labels, "ownerReferences": [OWNER]}


def test_job_children() -> None:
    job = jobs.job()
    assert builders.job_children(job) == [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta("demo-trainer")},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta("demo-status-writer"),
            "rules": [
                {
                    "apiGroups": ["cairn.dev"],
                    "resources": ["trainingjobs/status"],
                    "resourceNames": ["demo"],
                    "verbs": ["get", "patch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta("demo-status-writer"),
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "demo-status-writer",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "demo-trainer", "namespace": "ml"}],
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _meta("demo"),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": {"cairn.dev/job-name": "demo"},
                "ports": [{"name": "c10d", "port": 29500, "targetPort": 29500, "protocol": "TCP"}],
            },
        },
        # The manifest keyring: no data here; effects draws the key on create.
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": _meta("demo-manifest-key"),
            "type": "Opaque",
        },
        # The network boundary (test_netpol covers its rules).
        builders.network_policy(job),
    ]


def _env(pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    return [{"name": k, "value": v} for k, v in pairs]


MASTER = "demo-a3-n0.demo.ml.svc.cluster.local"


def test_pod_with_pvc_upload_overlay_and_user_env() -> None:
    job = jobs.job(
        procsPerNode=1,
        command=["python", "-m", "cairn.trainer.reference"],
        args=["--steps", "10"],
        env=[{"name": "LOG_LEVEL", "value": "debug"}],
        resources={"limits": {"cpu": 2, "memory": "1Gi"}},
        template={
            "metadata": {"labels": {"team": "ml"}, "annotations": {"a": "b"}},
            "nodeSelector": {"pool": "cpu"},
            "priorityClassName": "low",
            "volumes": [{"name": "data", "emptyDir": {}}],
            "volumeMounts": [{"name": "data", "mountPath": "/data"}],
        },
        checkpoint={
            "intervalSteps": 5,
            "volume": {"persistentVolumeClaim": {"claimName": "ckpt", "subPath": "demo"}},
            "upload": {
                "uri": "s3://cairn-demo/demo",
                "endpoint": "http://127.0.0.1:8333",
                "credentialsSecretRef": {"name": "s3-creds"},
            },
            "finalCheckpointGraceSeconds": 120,
        },
    )
    resume = podenv.ResumeTarget(kind="step", step=40)
    got = builders.pod(job, attempt=3, rank=0, resume=resume)
    labels = {
        "team": "ml",
        "cairn.dev/job-name": "demo",
        "cairn.dev/attempt": "3",
        "cairn.dev/rank": "0",
        "app.kubernetes.io/managed-by": "cairn",
    }
    env = [
        *_env(
            [
                ("CAIRN_JOB_NAME", "demo"),
                ("CAIRN_NAMESPACE", "ml"),
                ("CAIRN_JOB_UID", "uid-1"),
                ("CAIRN_ATTEMPT", "3"),
            ]
        ),
        {"name": "CAIRN_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "CAIRN_POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
        *_env(
            [
                ("CAIRN_NODE_RANK", "0"),
                ("CAIRN_NNODES", "2"),
                ("CAIRN_NPROC_PER_NODE", "1"),
                ("CAIRN_RUNTIME", "torchrun"),
                ("CAIRN_MASTER_ADDR", MASTER),
                ("CAIRN_MASTER_PORT", "29500"),
                ("PET_NNODES", "2"),
                ("PET_NPROC_PER_NODE", "1"),
                ("PET_NODE_RANK", "0"),
                ("PET_MASTER_ADDR", MASTER),
                ("PET_MASTER_PORT", "29500"),
                ("PET_MAX_RESTARTS", "0"),
                ("MASTER_ADDR", MASTER),
                ("MASTER_PORT", "29500"),
                ("WORLD_SIZE", "2"),
                ("RANK", "0"),
                ("LOCAL_RANK", "0"),
                ("LOCAL_WORLD_SIZE", "1"),
                ("CAIRN_CHECKPOINT_DIR", "/checkpoints"),
                ("CAIRN_ASYNC_MODE", "pinned"),
                ("CAIRN_KEEP_LAST", "3"),
                ("CAIRN_FINAL_CHECKPOINT_GRACE_SECONDS", "120"),
                ("CAIRN_RESUME_FROM", "step:40"),
                ("CAIRN_MANIFEST_KEYRING", "/var/run/cairn/manifest-key/keyring.json"),
                ("CAIRN_REPORT_STATUS", "1"),
                ("CAIRN_STATUS_INTERVAL_SECONDS", "30"),
                ("CAIRN_CHECKPOINT_INTERVAL_STEPS", "5"),
                ("CAIRN_UPLOAD_URI", "s3://cairn-demo/demo"),
                ("CAIRN_UPLOAD_CONCURRENCY", "8"),
                ("CAIRN_UPLOAD_ON_FAILURE", "Continue"),
                ("CAIRN_UPLOAD_STALL_SECONDS", "30"),
                ("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:8333"),
            ]
        ),
        {
            "name": "AWS_ACCESS_KEY_ID",
            "valueFrom": {"secretKeyRef": {"name": "s3-creds", "key": "AWS_ACCESS_KEY_ID"}},
        },
        {
            "name": "AWS_SECRET_ACCESS_KEY",
            "valueFrom": {"secretKeyRef": {"name": "s3-creds", "key": "AWS_SECRET_ACCESS_KEY"}},
        },
        {"name": "LOG_LEVEL", "value": "debug"},
    ]
    assert got == {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "demo-a3-n0",
            "namespace": "ml",
            "labels": labels,
            "annotations": {"a": "b"},
            "ownerReferences": [OWNER],
        },
        "spec": {
            "restartPolicy": "Never",
            "hostname": "demo-a3-n0",
            "subdomain": "demo",
            "serviceAccountName": "demo-trainer",
            "automountServiceAccountToken": True,
            "terminationGracePeriodSeconds": 120,
            "securityContext": builders.POD_SECURITY_DEFAULTS,
            "containers": [
                {
                    "name": "trainer",
                    "image": "cairn-trainer:dev",
                    "securityContext": builders.CONTAINER_SECURITY_DEFAULTS,
                    "terminationMessagePath": "/dev/termination-log",
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                    "command": ["python", "-m", "cairn.trainer.reference"],
                    "args": ["--steps", "10"],
                    "env": env,
                    "ports": [{"name": "c10d", "containerPort": 29500, "protocol": "TCP"}],
                    "resources": {"limits": {"cpu": 2, "memory": "1Gi"}},
                    "volumeMounts": [
                        {
                            "name": "cairn-checkpoints",
                            "mountPath": "/checkpoints",
                            "subPath": "demo",
                        },
                        {
                            "name": "cairn-manifest-key",
                            "mountPath": "/var/run/cairn/manifest-key",
                            "readOnly": True,
                        },
                        {"name": "data", "mountPath": "/data"},
                    ],
                }
            ],
            "volumes": [
                {"name": "cairn-checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}},
                {
                    "name": "cairn-manifest-key",
                    "secret": {
                        "secretName": "demo-manifest-key",
                        "defaultMode": 0o444,
                        "items": [{"key": "keyring.json", "path": "keyring.json"}],
                    },
                },
                {"name": "data", "emptyDir": {}},
            ],
            "nodeSelector": {"pool": "cpu"},
            "priorityClassName": "low",
        },
    }


def test_minimal_pod_multi_proc_has_no_per_process_rank() -> None:
    job = jobs.job(procsPerNode=4)
    got = builders.pod(job, attempt=1, rank=1, resume=podenv.ResumeTarget(kind="latest"))
    env = {e["name"]: e.get("value") for e in got["spec"]["containers"][0]["env"]}
    assert env["WORLD_SIZE"] == "8"
    assert env["PET_NPROC_PER_NODE"] == "4"
    assert "RANK" not in env and "LOCAL_RANK" not in env
    assert env["CAIRN_REPORT_STATUS"] == "0"
    assert got["spec"]["volumes"] == [
        {"name": "cairn-checkpoints", "emptyDir": {}},
        {
            "name": "cairn-manifest-key",
            "secret": {
                "secretName": "demo-manifest-key",
                "defaultMode": 0o444,
                "items": [{"key": "keyring.json", "path": "keyring.json"}],
            },
        },
    ]
    assert "command" not in got["spec"]["containers"][0]
    assert not any(k.startswith("AWS_") for k in env)


def test_attempt_pods_are_named_deterministically() -> None:
    pods = builders.attempt_pods(
        jobs.job(nodes=3), attempt=2, resume=podenv.ResumeTarget(kind="none")
    )
    assert [p["metadata"]["name"] for p in pods] == ["demo-a2-n0", "demo-a2-n1", "demo-a2-n2"]
    assert names.master_addr(job="demo", namespace="ml", attempt=2) == (
        "demo-a2-n0.demo.ml.svc.cluster.local"
    )


def test_pods_meet_restricted_and_the_overlay_merges_over_it() -> None:
    plain = builders.pod(jobs.job(), attempt=1, rank=0, resume=podenv.ResumeTarget(kind="latest"))
    assert plain["spec"]["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert plain["spec"]["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    job = jobs.job(
        template={
            "securityContext": {"runAsUser": 1000, "fsGroup": 2000},
            "containerSecurityContext": {"readOnlyRootFilesystem": True},
        }
    )
    got = builders.pod(job, attempt=1, rank=0, resume=podenv.ResumeTarget(kind="latest"))
    assert got["spec"]["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
        "runAsUser": 1000,
        "fsGroup": 2000,
    }
    assert got["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    assert got["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False


def test_privileged_overlay_drops_the_escalation_default() -> None:
    assert builders.container_security({"privileged": True}) == {
        "capabilities": {"drop": ["ALL"]},
        "privileged": True,
    }


def test_overlay_scheduling_and_containers_pass_through() -> None:
    gate = {"name": "example.com/quota"}
    spread = {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}
    job = jobs.job(
        template={
            "serviceAccountName": "team-sa",
            "schedulingGates": [gate],
            "topologySpreadConstraints": [spread],
            "runtimeClassName": "nvidia",
            "envFrom": [{"secretRef": {"name": "wandb"}}],
            "initContainers": [{"name": "fetch", "image": "busybox", "command": ["true"]}],
            "sidecars": [{"name": "proxy", "image": "envoy"}],
        }
    )
    got = builders.pod(job, attempt=1, rank=0, resume=podenv.ResumeTarget(kind="latest"))
    spec = got["spec"]
    assert spec["serviceAccountName"] == "team-sa"
    assert spec["schedulingGates"] == [gate]
    assert spec["topologySpreadConstraints"] == [spread]
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["containers"][0]["envFrom"] == [{"secretRef": {"name": "wandb"}}]
    init = spec["initContainers"]
    assert [(c["name"], c.get("restartPolicy")) for c in init] == [
        ("fetch", None),
        ("proxy", "Always"),
    ]
    assert all(c["securityContext"]["capabilities"] == {"drop": ["ALL"]} for c in init)
    binding = builders.role_binding(job)
    assert binding["subjects"][0]["name"] == "team-sa", "the status writer runs as team-sa"


def test_trainer_reports_its_termination_message() -> None:
    got = builders.pod(jobs.job(), attempt=1, rank=0, resume=podenv.ResumeTarget(kind="latest"))
    container = got["spec"]["containers"][0]
    assert container["terminationMessagePath"] == exitcodes.TERMINATION_MESSAGE_PATH
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
