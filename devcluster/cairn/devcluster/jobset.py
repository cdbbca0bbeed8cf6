"""JobSet's manager as a host process, for the fair scale anchor bench only.

`bench/scale_anchor.py --jobset` starts it on the bench's own control-plane
cluster: it builds the pinned manager from its Go module (cached under
`~/.cache/cairn/bin` like Kueue, never by `devcluster up` or the test suite),
applies JobSet's CRD and its four webhooks (JobSet create/update, and the pod
create webhooks restricted by JobSet's own objectSelector to pods labelled
with a JobSet name, as its kustomize patch does) pointed at loopback with a
serving certificate from the cluster's CA, starts the manager with the admin
client certificate and returns once a dry-run JobSet passes the webhooks.
`down` stops the manager by its PID and deletes what `up` applied (webhook
configurations first, so no pod create waits on a stopped webhook; then the
CRD, which takes any JobSet with it).

The pure parts (`webhook_configurations`, `manager_config`,
`manager_command`, `jobset`) map inputs to documents; the rest talks to the
API server and the file system. The API plumbing is Kueue's
(`kueue.apply`, `kueue.api_request`): the same admin, the same kinds.
"""

import base64
import copy
import dataclasses
import json
import os
import pathlib
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from cairn.devcluster import adminapi, build, errors, gomanager, kueue, processes

Target = adminapi.Target

JOBSET_VERSION = "v0.12.0"
# Not in `build.BUNDLES`: `devcluster up` never builds it.
BUNDLE = build.Bundle(
    name="jobset",
    version=JOBSET_VERSION,
    module_dir=build.GOMOD_DIR / "jobset",
    # The manager is the module's root package (main.go): the binary is `jobset`.
    packages=("sigs.k8s.io/jobset",),
    ldflags=f"-s -w -X sigs.k8s.io/jobset/pkg/version.GitVersion={JOBSET_VERSION}",
)
COMPONENT = "jobset"
API_GROUP = "jobset.x-k8s.io"
API_VERSION = f"{API_GROUP}/v1alpha2"
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
CRD_NAME = f"jobsets.{API_GROUP}"
CRD_IN_MODULE = "config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml"
WEBHOOK_MANIFESTS_IN_MODULE = "config/components/webhook/manifests.yaml"
WEBHOOK_CERT_STEM = "jobset-webhook"
READY_TIMEOUT_SECONDS = 120.0
STOP_GRACE_SECONDS = 10.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JobSetPorts:
    """Loopback ports of the manager: the webhook the API server calls, and probes."""

    webhook: int = 19543
    health: int = 19544


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ClientLimits:
    """The manager's client-side rate limit (JobSet's defaults: 500/500)."""

    qps: int = 500
    burst: int = 500


# ---------------------------------------------------------------- pure parts


def _pod_hook(hook: Mapping[str, Any]) -> bool:
    return any("" in rule.get("apiGroups", []) for rule in hook.get("rules", []))


def webhook_configurations(
    manifests: Sequence[Mapping[str, Any]], *, url_base: str, ca_bundle: bytes
) -> list[dict[str, Any]]:
    """Pure: JobSet's webhook configurations pointed at `url_base`, named `jobset-…`.

    The pod webhooks get JobSet's own objectSelector (its kustomize patch adds
    it; the generated manifests lack it): only pods of a JobSet are sent to
    the manager, so no other pod create depends on this one host process.
    """
    ca = base64.b64encode(ca_bundle).decode()
    out = []
    for manifest in manifests:
        doc = copy.deepcopy(dict(manifest))
        for hook in doc.get("webhooks", []):
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"{url_base}{path}", "caBundle": ca}
            hook.setdefault("sideEffects", "None")
            hook["timeoutSeconds"] = 10
            if _pod_hook(hook):
                hook["objectSelector"] = {
                    "matchExpressions": [{"key": JOBSET_NAME_LABEL, "operator": "Exists"}]
                }
        doc["metadata"] = {"name": f"jobset-{doc['metadata']['name']}"}
        out.append(doc)
    return out


def manager_config(*, cert_dir: pathlib.Path, ports: JobSetPorts) -> dict[str, Any]:
    """Pure: the manager's Configuration (config.jobset.x-k8s.io/v1alpha1)."""
    return {
        "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports.health}"},
        # "0" turns the metrics server off; nothing scrapes it here.
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": ports.webhook, "certDir": str(cert_dir)},
        # One manager, stopped by PID: no lease to wait out on restart.
        "leaderElection": {"leaderElect": False},
        # The cluster's CA signs the webhook certificate; JobSet's own rotator
        # would need a Service and a Secret the API server cannot reach on loopback.
        "internalCertManagement": {"enable": False},
    }


def manager_command(
    *, config_path: pathlib.Path, kubeconfig: pathlib.Path, limits: ClientLimits
) -> list[str]:
    """Pure: the manager's argv (the flags override the Configuration's client limits)."""
    return [
        str(BUNDLE.binary("jobset")),
        f"--config={config_path}",
        f"--kubeconfig={kubeconfig}",
        f"--kube-api-qps={limits.qps}",
        f"--kube-api-burst={limits.burst}",
        # Info level and JSON lines: the development default logs every reconcile.
        "--zap-log-level=info",
        "--zap-devel=false",
    ]


def jobset(
    name: str, *, replicas: int, pod_spec: Mapping[str, Any], namespace: str | None = None
) -> dict[str, Any]:
    """Pure: a JobSet of one replicated job whose Indexed Job runs `replicas` pods
    of `pod_spec` at once (completions = parallelism), failing on the first error."""
    if replicas < 1:
        raise errors.DevclusterError(f"a JobSet needs at least one pod, not {replicas}")
    metadata = {"name": name} | ({"namespace": namespace} if namespace else {})
    job_spec = {
        "completionMode": "Indexed",
        "completions": replicas,
        "parallelism": replicas,
        "backoffLimit": 0,
        "template": {"spec": copy.deepcopy(dict(pod_spec))},
    }
    return {
        "apiVersion": API_VERSION,
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            "replicatedJobs": [{"name": "workers", "replicas": 1, "template": {"spec": job_spec}}],
        },
    }


# ------------------------------------------------------------------ files


def module_dir() -> pathlib.Path:
    """Where the Go module cache holds the pinned JobSet module (downloaded if missing)."""
    env = dict(os.environ, GOTOOLCHAIN="local", GOFLAGS="-mod=mod")
    argv = ["go", "mod", "download", "-json", f"sigs.k8s.io/jobset@{JOBSET_VERSION}"]
    try:
        proc = subprocess.run(
            argv,
            cwd=BUNDLE.module_dir,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise errors.DevclusterError(f"cannot run `go mod download` for JobSet: {exc}") from exc
    if proc.returncode != 0:
        raise errors.DevclusterError(
            f"cannot find the JobSet {JOBSET_VERSION} module: {proc.stderr.strip()[-300:]}"
        )
    return pathlib.Path(json.loads(proc.stdout)["Dir"])


def crd(root: pathlib.Path) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.load((root / CRD_IN_MODULE).read_text(), Loader=kueue.YAML_LOADER)
    doc.pop("status", None)
    return doc


def state_dir(target: Target) -> pathlib.Path:
    return target.state.root / "jobset"


def _ensure_certs(target: Target) -> pathlib.Path:
    """The webhook's serving cert from the cluster's CA, where the manager reads it."""
    return gomanager.serving_certs(
        target,
        stem=WEBHOOK_CERT_STEM,
        common_name="jobset-webhook",
        cert_dir=state_dir(target) / "certs",
    )


# --------------------------------------------------------------- lifecycle


def running(target: Target) -> bool:
    return gomanager.running(target, COMPONENT)


def pid(target: Target) -> int:
    tracked = processes.read_pidfile(target.state.pidfile(COMPONENT))
    if tracked is None or not processes.is_alive(tracked):
        raise errors.DevclusterError("the JobSet manager is not running")
    return tracked.pid


def _webhooks_answer(target: Target) -> bool:
    """True when the API server reached the webhooks for a dry-run JobSet create."""
    probe = jobset(
        "cairn-devcluster-probe",
        replicas=1,
        pod_spec={"restartPolicy": "Never", "containers": [{"name": "c", "image": "none"}]},
    )
    path = f"/apis/{API_VERSION}/namespaces/default/jobsets?dryRun=All"
    status, _ = kueue.api_request(target, "POST", path, body=probe, timeout=15.0)
    return status in (200, 201, 409)


def up(
    target: Target,
    *,
    limits: ClientLimits,
    ports: JobSetPorts = JobSetPorts(),
    timeout: float = READY_TIMEOUT_SECONDS,
) -> float:
    """(Re)start the manager with `limits` (bounded); the seconds the build took."""
    build_seconds = build.build(BUNDLE, log=target.state.log("build-jobset"))
    processes.stop_pidfile(target.state.pidfile(COMPONENT), grace_seconds=STOP_GRACE_SECONDS)
    gomanager.refuse_busy_ports((ports.webhook, ports.health), who="JobSet")
    cert_dir = _ensure_certs(target)
    config_path = state_dir(target) / "config.yaml"
    config_path.write_text(yaml.safe_dump(manager_config(cert_dir=cert_dir, ports=ports)))
    root = module_dir()
    kueue.apply(target, crd(root))
    gomanager.wait_established(
        target, [CRD_NAME], failure=lambda _: f"the {CRD_NAME} CRD was not Established in 60 s"
    )
    manifests = [m for m in yaml.safe_load_all((root / WEBHOOK_MANIFESTS_IN_MODULE).read_text())]
    for config in webhook_configurations(
        [m for m in manifests if m],
        url_base=f"https://127.0.0.1:{ports.webhook}",
        ca_bundle=(target.state.pki / "ca.crt").read_bytes(),
    ):
        kueue.apply(target, config)
    processes.spawn(
        name=COMPONENT,
        argv=manager_command(
            config_path=config_path, kubeconfig=target.state.admin_kubeconfig, limits=limits
        ),
        log_path=target.state.log(COMPONENT),
        pidfile=target.state.pidfile(COMPONENT),
        env=dict(os.environ, TMPDIR=str(target.state.tmp)),
        cwd=target.state.root,
    )
    _wait_ready(target, ports, deadline=time.monotonic() + timeout)
    return build_seconds


def _wait_ready(target: Target, ports: JobSetPorts, *, deadline: float) -> None:
    gomanager.wait_ready(
        target,
        component=COMPONENT,
        ready=lambda: gomanager.ready_probe(ports.health) and _webhooks_answer(target),
        deadline=deadline,
        exited="the JobSet manager exited while starting",
        timed_out="timed out waiting for JobSet's webhooks",
    )


def installed_paths() -> list[str]:
    """Pure: the API paths of what `up` applies, webhooks first (the order `down` deletes)."""
    out = [
        f"/apis/admissionregistration.k8s.io/v1/{kind}/jobset-{name}"
        for kind, name in (
            ("mutatingwebhookconfigurations", "mutating-webhook-configuration"),
            ("validatingwebhookconfigurations", "validating-webhook-configuration"),
        )
    ]
    return [*out, f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}"]


def down(target: Target) -> None:
    """Stop the manager by its PID; delete its webhook configurations and CRD."""
    processes.stop_pidfile(target.state.pidfile(COMPONENT), grace_seconds=STOP_GRACE_SECONDS)
    for path in installed_paths():
        status, body = kueue.api_request(target, "DELETE", path)
        if status not in (200, 202, 404):
            raise errors.DevclusterError(
                f"deleting {path} failed ({status}): {body.get('message', body)}"
            )
