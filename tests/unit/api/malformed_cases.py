"""Malformed TrainingJobs: one data table, replayed by the model tests now and
against the real API server later.

Each case deep-merges ``patch`` into :data:`BASE` (a value of ``DELETE``
removes the key) and names the field the error must point at. ``server``
says how the API server rejects it: ``schema`` (OpenAPI: types, ranges, enums,
patterns), ``cel`` (x-kubernetes-validations) or ``strict`` (an unknown field,
rejected only with ``fieldValidation=Strict``, kubectl's default).
"""

import copy
import dataclasses
from typing import Any, Literal

DELETE = object()

BASE: dict[str, Any] = {
    "apiVersion": "cairn.dev/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "malformed", "namespace": "default"},
    "spec": {
        "nodes": 2,
        "image": "cairn-trainer:dev",
        "command": ["python", "-m", "cairn.trainer.reference"],
        "checkpoint": {
            "intervalSteps": 5,
            "upload": {"uri": "s3://cairn-demo/malformed"},
        },
    },
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    id: str
    patch: dict[str, Any]
    field: str
    """Dotted path of the offending field, as the API server reports it."""
    server: Literal["schema", "cel", "strict"] = "schema"


def _merge(into: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if value is DELETE:
            into.pop(key, None)
        elif isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = copy.deepcopy(value)


def build(case: Case) -> dict[str, Any]:
    body = copy.deepcopy(BASE)
    _merge(body, case.patch)
    return body


def _spec(**fields: Any) -> dict[str, Any]:
    return {"spec": fields}


def _ckpt(**fields: Any) -> dict[str, Any]:
    return {"spec": {"checkpoint": fields}}


CASES: tuple[Case, ...] = (
    Case(id="no-spec", patch={"spec": DELETE}, field="spec"),
    Case(id="no-image", patch=_spec(image=DELETE), field="spec.image"),
    Case(id="empty-image", patch=_spec(image=""), field="spec.image"),
    Case(id="zero-nodes", patch=_spec(nodes=0), field="spec.nodes"),
    Case(id="too-many-nodes", patch=_spec(nodes=5000), field="spec.nodes"),
    Case(id="nodes-string", patch=_spec(nodes="two"), field="spec.nodes"),
    Case(id="zero-procs", patch=_spec(procsPerNode=0), field="spec.procsPerNode"),
    Case(id="too-many-procs", patch=_spec(procsPerNode=65), field="spec.procsPerNode"),
    Case(id="suspend-string", patch=_spec(suspend="yes"), field="spec.suspend"),
    Case(id="command-string", patch=_spec(command="python train.py"), field="spec.command"),
    Case(
        id="deadline-zero", patch=_spec(activeDeadlineSeconds=0), field="spec.activeDeadlineSeconds"
    ),
    Case(id="unknown-field", patch=_spec(gpus=8), field="spec.gpus", server="strict"),
    Case(
        id="env-reserved",
        patch=_spec(env=[{"name": "CAIRN_ATTEMPT", "value": "9"}]),
        field="spec.env[0].name",
        server="cel",
    ),
    Case(
        id="env-value-and-from",
        patch=_spec(env=[{"name": "A", "value": "1", "valueFrom": {"fieldRef": {}}}]),
        field="spec.env[0]",
        server="cel",
    ),
    Case(
        id="env-bad-name",
        patch=_spec(env=[{"name": "1 A", "value": "x"}]),
        field="spec.env[0].name",
    ),
    Case(
        id="reserved-volume",
        patch=_spec(template={"volumes": [{"name": "cairn-checkpoints", "emptyDir": {}}]}),
        field="spec.template.volumes",
        server="cel",
    ),
    Case(
        id="reserved-volume-memory",
        patch=_spec(template={"volumes": [{"name": "cairn-memory", "emptyDir": {}}]}),
        field="spec.template.volumes",
        server="cel",
    ),
    Case(
        id="node-selector-int",
        patch=_spec(template={"nodeSelector": {"zone": 3}}),
        field="spec.template.nodeSelector.zone",
    ),
    Case(id="async-mode", patch=_ckpt(asyncMode="fast"), field="spec.checkpoint.asyncMode"),
    Case(id="mount-relative", patch=_ckpt(mountPath="ckpt"), field="spec.checkpoint.mountPath"),
    Case(
        id="interval-steps-0", patch=_ckpt(intervalSteps=0), field="spec.checkpoint.intervalSteps"
    ),
    Case(
        id="interval-seconds-neg",
        patch=_ckpt(intervalSeconds=-5),
        field="spec.checkpoint.intervalSeconds",
    ),
    Case(
        id="keep-last-1",
        patch=_ckpt(retention={"local": {"keepLast": 1}}),
        field="spec.checkpoint.retention.local.keepLast",
        server="cel",
    ),
    Case(
        id="keep-last-0",
        patch=_ckpt(retention={"local": {"keepLast": 0}}),
        field="spec.checkpoint.retention.local.keepLast",
        server="cel",
    ),
    Case(
        id="max-bytes-0",
        patch=_ckpt(retention={"local": {"maxBytes": 0}}),
        field="spec.checkpoint.retention.local.maxBytes",
    ),
    Case(
        id="remote-keep-last-0",
        patch=_ckpt(retention={"remote": {"keepLast": 0}}),
        field="spec.checkpoint.retention.remote.keepLast",
    ),
    Case(
        id="remote-without-upload",
        patch=_ckpt(upload=DELETE, retention={"remote": {"keepLast": 3}}),
        field="spec.checkpoint.retention.remote",
        server="cel",
    ),
    Case(
        id="uri-http",
        patch=_ckpt(upload={"uri": "http://bucket/prefix"}),
        field="spec.checkpoint.upload.uri",
        server="cel",
    ),
    Case(
        id="uri-no-bucket",
        patch=_ckpt(upload={"uri": "s3://"}),
        field="spec.checkpoint.upload.uri",
        server="cel",
    ),
    Case(
        id="uri-uppercase-bucket",
        patch=_ckpt(upload={"uri": "s3://Bucket/prefix"}),
        field="spec.checkpoint.upload.uri",
        server="cel",
    ),
    Case(
        id="endpoint-no-scheme",
        patch=_ckpt(upload={"endpoint": "minio:9000"}),
        field="spec.checkpoint.upload.endpoint",
        server="cel",
    ),
    Case(
        id="concurrency-0",
        patch=_ckpt(upload={"concurrency": 0}),
        field="spec.checkpoint.upload.concurrency",
    ),
    Case(
        id="secret-ref-no-name",
        patch=_ckpt(upload={"credentialsSecretRef": {"accessKeyIdKey": "id"}}),
        field="spec.checkpoint.upload.credentialsSecretRef.name",
    ),
    Case(
        id="resume-empty",
        patch=_ckpt(resume={}),
        field="spec.checkpoint.resume",
        server="cel",
    ),
    Case(
        id="resume-two-forms",
        patch=_ckpt(resume={"latest": True, "step": 5}),
        field="spec.checkpoint.resume",
        server="cel",
    ),
    Case(
        id="resume-latest-false",
        patch=_ckpt(resume={"latest": False}),
        field="spec.checkpoint.resume.latest",
        server="cel",
    ),
    Case(
        id="resume-negative-step",
        patch=_ckpt(resume={"step": -1}),
        field="spec.checkpoint.resume.step",
    ),
    Case(
        id="resume-gcs-uri",
        patch=_ckpt(resume={"uri": "gs://bucket/step-000000010"}),
        field="spec.checkpoint.resume.uri",
        server="cel",
    ),
    Case(
        id="resume-uri-without-upload",
        patch=_ckpt(upload=DELETE, resume={"uri": "s3://other/run/step-000000010"}),
        field="spec.checkpoint.resume.uri",
        server="cel",
    ),
    Case(id="volume-empty", patch=_ckpt(volume={}), field="spec.checkpoint.volume", server="cel"),
    Case(
        id="volume-both",
        patch=_ckpt(volume={"emptyDir": {}, "persistentVolumeClaim": {"claimName": "c"}}),
        field="spec.checkpoint.volume",
        server="cel",
    ),
    Case(
        id="pvc-no-claim",
        patch=_ckpt(volume={"persistentVolumeClaim": {}}),
        field="spec.checkpoint.volume.persistentVolumeClaim.claimName",
    ),
    Case(id="on-delete", patch=_ckpt(onDelete="Purge"), field="spec.checkpoint.onDelete"),
    Case(
        id="grace-too-short",
        patch=_ckpt(finalCheckpointGraceSeconds=5),
        field="spec.checkpoint.finalCheckpointGraceSeconds",
    ),
    Case(
        id="max-restarts-neg",
        patch=_spec(restartPolicy={"maxRestarts": -1}),
        field="spec.restartPolicy.maxRestarts",
    ),
    Case(
        id="backoff-above-max",
        patch=_spec(restartPolicy={"backoffSeconds": 100, "maxBackoffSeconds": 10}),
        field="spec.restartPolicy",
        server="cel",
    ),
    Case(
        id="exit-code-0",
        patch=_spec(restartPolicy={"retryableExitCodes": [0]}),
        field="spec.restartPolicy.retryableExitCodes[0]",
    ),
    Case(
        id="exit-code-256",
        patch=_spec(restartPolicy={"retryableExitCodes": [256]}),
        field="spec.restartPolicy.retryableExitCodes[0]",
    ),
    Case(
        id="cleanup-enum",
        patch=_spec(cleanup={"finishedPods": "Sometimes"}),
        field="spec.cleanup.finishedPods",
    ),
    Case(
        id="name-too-long",
        patch={"metadata": {"name": "a" * 50}},
        field="metadata.name",
        server="cel",
    ),
    # issue 10: quantities, mountPath and managedBy are checked at admission.
    Case(
        id="cpu-not-a-quantity",
        patch=_spec(resources={"requests": {"cpu": "lots"}}),
        field="spec.resources.requests",
        server="cel",
    ),
    Case(
        id="memory-negative",
        patch=_spec(resources={"limits": {"memory": "-1Gi"}}),
        field="spec.resources.limits",
        server="cel",
    ),
    Case(
        id="size-limit-not-a-quantity",
        patch=_ckpt(volume={"emptyDir": {"sizeLimit": "big"}}),
        field="spec.checkpoint.volume.emptyDir.sizeLimit",
        server="cel",
    ),
    Case(
        id="memory-enabled-without-size",
        patch=_ckpt(memory={"enabled": True}),
        field="spec.checkpoint.memory.sizeLimit",
        server="cel",
    ),
    Case(
        id="memory-size-not-a-quantity",
        patch=_ckpt(memory={"enabled": True, "sizeLimit": "lots"}),
        field="spec.checkpoint.memory.sizeLimit",
        server="cel",
    ),
    Case(
        id="upload-interval-not-a-multiple",
        patch=_ckpt(upload={"uri": "s3://cairn-demo/malformed", "intervalSteps": 7}),
        field="spec.checkpoint.upload.intervalSteps",
        server="cel",
    ),
    Case(
        id="upload-interval-with-interval-seconds",
        patch=_ckpt(
            intervalSteps=DELETE,
            intervalSeconds=60,
            upload={"uri": "s3://cairn-demo/malformed", "intervalSteps": 10},
        ),
        field="spec.checkpoint.upload.intervalSteps",
        server="cel",
    ),
    Case(
        id="upload-interval-zero",
        patch=_ckpt(upload={"uri": "s3://cairn-demo/malformed", "intervalSteps": 0}),
        field="spec.checkpoint.upload.intervalSteps",
    ),
    Case(
        id="memory-replicas-two",
        patch=_ckpt(memory={"enabled": True, "sizeLimit": "1Gi", "replicas": 2}),
        field="spec.checkpoint.memory.replicas",
    ),
    Case(
        id="memory-over-the-limit",
        patch={
            "spec": {
                "resources": {"limits": {"memory": "2Gi"}},
                "checkpoint": {"memory": {"enabled": True, "sizeLimit": "2Gi"}},
            }
        },
        field="spec.checkpoint.memory.sizeLimit",
        server="cel",
    ),
    Case(
        id="mount-dotdot",
        patch=_ckpt(mountPath="/checkpoints/../etc"),
        field="spec.checkpoint.mountPath",
        server="cel",
    ),
    Case(
        id="mount-root", patch=_ckpt(mountPath="/"), field="spec.checkpoint.mountPath", server="cel"
    ),
    Case(
        id="mount-etc",
        patch=_ckpt(mountPath="/etc"),
        field="spec.checkpoint.mountPath",
        server="cel",
    ),
    Case(
        id="mount-under-proc",
        patch=_ckpt(mountPath="/proc/ckpt"),
        field="spec.checkpoint.mountPath",
        server="cel",
    ),
    Case(
        id="mount-var-run",
        patch=_ckpt(mountPath="/var/run/secrets"),
        field="spec.checkpoint.mountPath",
        server="cel",
    ),
    Case(id="managed-by-no-domain", patch=_spec(managedBy="kueue"), field="spec.managedBy"),
    Case(
        id="managed-by-uppercase-domain",
        patch=_spec(managedBy="Example.com/ctl"),
        field="spec.managedBy",
    ),
    Case(
        id="startup-deadline-zero",
        patch=_spec(startupDeadlineSeconds=0),
        field="spec.startupDeadlineSeconds",
    ),
    Case(
        id="progress-deadline-zero",
        patch=_spec(progressDeadlineSeconds=0),
        field="spec.progressDeadlineSeconds",
    ),
    Case(
        id="max-preemptions-neg",
        patch=_spec(restartPolicy={"maxPreemptions": -1}),
        field="spec.restartPolicy.maxPreemptions",
    ),
    Case(
        id="service-account-not-a-name",
        patch=_spec(template={"serviceAccountName": "My SA"}),
        field="spec.template.serviceAccountName",
    ),
    Case(
        id="name-not-dns-label",
        patch={"metadata": {"name": "my.job"}},
        field="metadata.name",
        server="cel",
    ),
)
