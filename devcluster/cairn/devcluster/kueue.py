"""Kueue in the devcluster: its CRDs, webhooks and manager as a host process.

`up` is idempotent and bounded: it builds the pinned manager (cached like
etcd/Kubernetes), applies Kueue's own CRDs from the Go module (served and
stored as `v1beta2` only: the base files carry no conversion webhook, so a
second served version would be converted by renaming alone), installs the
webhook configurations for Kueue's own `kueue.x-k8s.io` resources (never for
pods, Jobs or Deployments, so nothing else in the cluster depends on Kueue
running), starts the manager against the API server with the admin client
certificate, and returns once a dry-run Workload passes Kueue's webhooks.

The pure parts (`served_v1beta2`, `webhook_configurations`,
`manager_config`, `manager_command`, the queue manifests) map inputs to
documents; the rest talks to the API server and the file system.
"""

import base64
import contextlib
import copy
import dataclasses
import fcntl
import json
import os
import pathlib
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import yaml

from cairn.devcluster import adminapi, build, errors, gomanager, processes

Target = adminapi.Target


COMPONENT = "kueue"
API_GROUP = "kueue.x-k8s.io"
API_VERSION = f"{API_GROUP}/v1beta2"
NAMESPACE = "kueue-system"
DEFAULT_FLAVOR = "default-flavor"
CLUSTER_QUEUE = "cairn-cq"
LOCAL_QUEUE = "cairn-lq"
# The devcluster's two nodes together: a queue that never limits below the nodes.
DEFAULT_QUOTA: Mapping[str, str] = {"cpu": "16", "memory": "32Gi", "nvidia.com/gpu": "2"}
# PriorityBoost (alpha, off by default in v0.19.2) lets Cairn raise a Workload's
# effective priority by its uncommitted work (KEP-7990). VisibilityOnDemand
# needs an aggregated API server (an APIService backed by a Service), which a
# host process on loopback cannot be.
FEATURE_GATES: Mapping[str, bool] = {"PriorityBoost": True, "VisibilityOnDemand": False}
# Kueue v0.19.2 opens these even with metrics off (cmd/kueue/main.go) unless
# internal cert management is on; the path is hard-coded.
METRICS_CERT_DIR = pathlib.Path("/etc/kueue/metrics/certs")
FIELD_MANAGER = "cairn-devcluster"
READY_TIMEOUT_SECONDS = 180.0
STOP_GRACE_SECONDS = 10.0
WEBHOOK_CERT_STEM = "kueue-webhook"
CRD_DIR_IN_MODULE = "config/components/crd/bases"
WEBHOOK_MANIFESTS_IN_MODULE = "config/components/webhook/manifests.yaml"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class KueuePorts:
    """Loopback ports of the manager: the webhook the API server calls, and probes."""

    webhook: int = 19443
    health: int = 19444


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class KueueReport:
    already_running: bool
    ready_seconds: float
    build_seconds: float


# ---------------------------------------------------------------- pure parts


def served_v1beta2(crd: Mapping[str, Any]) -> dict[str, Any]:
    """Pure: `crd` serving and storing only `v1beta2`, with no conversion stanza."""
    doc = copy.deepcopy(dict(crd))
    versions = [v for v in doc["spec"]["versions"] if v["name"] == "v1beta2"]
    if not versions:
        raise errors.DevclusterError(f"CRD {doc['metadata']['name']} has no v1beta2 version")
    versions[0]["served"] = True
    versions[0]["storage"] = True
    doc["spec"]["versions"] = versions
    doc["spec"].pop("conversion", None)
    doc.pop("status", None)
    return dict(doc)


def _own_webhooks(webhooks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        w
        for w in webhooks
        if {group for rule in w.get("rules", []) for group in rule["apiGroups"]} == {API_GROUP}
    ]


def webhook_configurations(
    manifests: Sequence[Mapping[str, Any]], *, url_base: str, ca_bundle: bytes
) -> list[dict[str, Any]]:
    """Pure: Kueue's webhook configurations for its own resources, pointed at `url_base`.

    Webhooks of the job integrations (pods, Jobs, Deployments, ...) are dropped:
    with failurePolicy Fail they would make every pod creation in the cluster
    depend on this one host process.
    """
    ca = base64.b64encode(ca_bundle).decode()
    out = []
    for manifest in manifests:
        doc = copy.deepcopy(dict(manifest))
        hooks = _own_webhooks(doc.get("webhooks", []))
        for hook in hooks:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"{url_base}{path}", "caBundle": ca}
            hook.setdefault("sideEffects", "None")
            hook["timeoutSeconds"] = 10
        doc["metadata"] = {"name": f"kueue-{doc['metadata']['name']}"}
        doc["webhooks"] = hooks
        out.append(doc)
    return out


def manager_config(*, cert_dir: pathlib.Path, ports: KueuePorts) -> dict[str, Any]:
    """Pure: the manager's Configuration (config.kueue.x-k8s.io/v1beta2)."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "health": {"healthProbeBindAddress": f"127.0.0.1:{ports.health}"},
        # "0" turns the metrics server off; nothing scrapes it here.
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": ports.webhook, "certDir": str(cert_dir)},
        # One manager per devcluster, stopped by PID: no lease to wait out on restart.
        "leaderElection": {"leaderElect": False},
        # The devcluster's CA signs the webhook certificate; Kueue's own rotator
        # would need a Service and a Secret the API server cannot reach on loopback.
        "internalCertManagement": {"enable": False},
        "manageJobsWithoutQueueName": False,
        "integrations": {"frameworks": ["batch/job"]},
        "featureGates": dict(FEATURE_GATES),
    }


def manager_command(*, config_path: pathlib.Path, kubeconfig: pathlib.Path) -> list[str]:
    """Pure: the manager's argv."""
    return [
        str(build.KUEUE.binary("kueue")),
        f"--config={config_path}",
        f"--kubeconfig={kubeconfig}",
        # Info level: V(2) logs every reconcile, ~300 KB a minute under test load.
        "--zap-log-level=info",
    ]


def resource_flavor(name: str = DEFAULT_FLAVOR) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "ResourceFlavor", "metadata": {"name": name}}


def cluster_queue(
    *,
    name: str = CLUSTER_QUEUE,
    quota: Mapping[str, str] = DEFAULT_QUOTA,
    flavor: str = DEFAULT_FLAVOR,
) -> dict[str, Any]:
    """Pure: a ClusterQueue for every namespace, one flavor, covering exactly `quota`'s keys."""
    if not quota:
        raise errors.DevclusterError("a ClusterQueue needs at least one resource quota")
    resources = sorted(quota)
    return {
        "apiVersion": API_VERSION,
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {},
            "queueingStrategy": "BestEffortFIFO",
            "preemption": {"withinClusterQueue": "LowerPriority", "reclaimWithinCohort": "Never"},
            "resourceGroups": [
                {
                    "coveredResources": resources,
                    "flavors": [
                        {
                            "name": flavor,
                            "resources": [
                                {"name": r, "nominalQuota": str(quota[r])} for r in resources
                            ],
                        }
                    ],
                }
            ],
        },
    }


def local_queue(
    *, namespace: str, name: str = LOCAL_QUEUE, cluster_queue_name: str = CLUSTER_QUEUE
) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "LocalQueue",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"clusterQueue": cluster_queue_name},
    }


_PLURALS = {
    "CustomResourceDefinition": "customresourcedefinitions",
    "MutatingWebhookConfiguration": "mutatingwebhookconfigurations",
    "ValidatingWebhookConfiguration": "validatingwebhookconfigurations",
    "Namespace": "namespaces",
    "ResourceFlavor": "resourceflavors",
    "ClusterQueue": "clusterqueues",
    "LocalQueue": "localqueues",
    "Workload": "workloads",
    "WorkloadPriorityClass": "workloadpriorityclasses",
}


def object_path(obj: Mapping[str, Any]) -> str:
    """Pure: the API path of `obj` (one of the kinds this module applies)."""
    api_version = obj["apiVersion"]
    prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    namespace = obj["metadata"].get("namespace")
    scope = f"/namespaces/{namespace}" if namespace else ""
    return f"{prefix}{scope}/{_PLURALS[obj['kind']]}/{obj['metadata']['name']}"


# ------------------------------------------------------------ API plumbing


def api_request(
    target: Target,
    method: str,
    path: str,
    *,
    body: Mapping[str, Any] | None = None,
    content_type: str = "application/json",
    timeout: float = 30.0,
) -> tuple[int, dict[str, Any]]:
    """One request as the admin: (status, JSON body); status 0 if unreachable."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(target.server + path, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(
            request, timeout=timeout, context=adminapi.admin_ssl_context(target)
        ) as resp:
            return int(resp.status), _json(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, _json(exc.read())
    except (urllib.error.URLError, OSError):
        return 0, {}


def _json(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        return {"message": raw.decode(errors="replace")}
    return value if isinstance(value, dict) else {}


def apply(target: Target, obj: Mapping[str, Any]) -> dict[str, Any]:
    """Server-side apply `obj` as the devcluster's field manager; the object as stored."""
    query = urllib.parse.urlencode({"fieldManager": FIELD_MANAGER, "force": "true"})
    status, body = api_request(
        target,
        "PATCH",
        f"{object_path(obj)}?{query}",
        body=obj,
        content_type="application/apply-patch+yaml",
    )
    if status not in {200, 201}:
        raise errors.DevclusterError(
            f"applying {obj['kind']} {obj['metadata']['name']} failed ({status}): "
            f"{body.get('message', body)}"
        )
    return body


# ------------------------------------------------------------------ files


def module_dir() -> pathlib.Path:
    """Where the Go module cache holds the pinned Kueue module (downloaded if missing)."""
    go = shutil.which("go")
    if go is None:
        raise errors.DevclusterError("Go is not on PATH: it locates Kueue's CRDs in its module")
    env = dict(os.environ, GOTOOLCHAIN="local", GOFLAGS="-mod=mod")
    try:
        proc = subprocess.run(
            [go, "mod", "download", "-json", f"sigs.k8s.io/kueue@{build.KUEUE_VERSION}"],
            cwd=build.KUEUE.module_dir,
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
    except subprocess.TimeoutExpired as exc:
        raise errors.DevclusterError(
            f"downloading the Kueue {build.KUEUE_VERSION} module took over 300 s: check GOPROXY"
        ) from exc
    if proc.returncode != 0:
        raise errors.DevclusterError(
            f"cannot find the Kueue {build.KUEUE_VERSION} module: {proc.stderr.strip()[-300:]}"
        )
    return pathlib.Path(json.loads(proc.stdout)["Dir"])


# libyaml's loader when PyYAML has it: the Workload CRD is 1.3 MB of YAML, which
# the pure-Python loader takes seconds to read on this machine.
YAML_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def crds(root: pathlib.Path) -> list[dict[str, Any]]:
    return [
        served_v1beta2(yaml.load(path.read_text(), Loader=YAML_LOADER))
        for path in sorted((root / CRD_DIR_IN_MODULE).glob("*.yaml"))
    ]


def state_dir(target: Target) -> pathlib.Path:
    return target.state.root / "kueue"


def _ensure_certs(target: Target) -> pathlib.Path:
    """The webhook's serving cert from the devcluster CA, where Kueue reads it."""
    cert_dir = gomanager.serving_certs(
        target,
        stem=WEBHOOK_CERT_STEM,
        common_name="kueue-webhook",
        cert_dir=state_dir(target) / "certs",
    )
    # Kueue only loads these (metrics are off); a pair someone put there stays.
    if not ((METRICS_CERT_DIR / "tls.crt").exists() and (METRICS_CERT_DIR / "tls.key").exists()):
        try:
            METRICS_CERT_DIR.mkdir(parents=True, exist_ok=True)
            for name in ("tls.crt", "tls.key"):
                gomanager.copy_private(cert_dir / name, METRICS_CERT_DIR / name)
        except OSError as exc:
            raise errors.DevclusterError(
                f"cannot write {METRICS_CERT_DIR}/tls.{{crt,key}} ({exc.strerror}): Kueue "
                f"{build.KUEUE_VERSION} will not start without them; create them as root"
            ) from exc
    return cert_dir


# --------------------------------------------------------------- lifecycle


def running(target: Target) -> bool:
    return gomanager.running(target, COMPONENT)


def workload(
    name: str,
    *,
    namespace: str | None = None,
    queue: str | None = None,
    priority: int | None = None,
    requests: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Pure: a Workload of one pod that runs nothing (the webhook probe below; the
    devcluster's Kueue tests and bench queue them by hand)."""
    container: dict[str, Any] = {"name": "c", "image": "none"}
    if requests:
        container["resources"] = {"requests": dict(requests)}
    metadata = {"name": name} | ({"namespace": namespace} if namespace else {})
    spec: dict[str, Any] = {}
    if queue is not None:
        spec["queueName"] = queue
    if priority is not None:
        spec["priority"] = priority
    spec["podSets"] = [
        {
            "name": "main",
            "count": 1,
            "template": {"spec": {"restartPolicy": "Never", "containers": [container]}},
        }
    ]
    return {"apiVersion": API_VERSION, "kind": "Workload", "metadata": metadata, "spec": spec}


def probe_workload(namespace: str = "default") -> dict[str, Any]:
    """Pure: the smallest valid Workload, used in a dry-run create through the webhooks."""
    return workload("cairn-devcluster-probe", namespace=namespace)


def _webhooks_answer(target: Target) -> bool:
    """True when the API server reached Kueue's webhooks for a dry-run Workload create."""
    probe = probe_workload()
    path = object_path(probe).rsplit("/", 1)[0] + "?dryRun=All"
    status, _ = api_request(target, "POST", path, body=probe, timeout=15.0)
    return status in (200, 201, 409)


def _ready(target: Target, ports: KueuePorts) -> bool:
    return running(target) and gomanager.ready_probe(ports.health) and _webhooks_answer(target)


@contextlib.contextmanager
def _exclusive(target: Target) -> Iterator[None]:
    """Serialize kueue up/down across test sessions (not the cluster's own lock)."""
    target.state.root.mkdir(parents=True, exist_ok=True)
    with (target.state.root / ".kueue.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def up(
    target: Target,
    *,
    timeout: float = READY_TIMEOUT_SECONDS,
    ports: KueuePorts = KueuePorts(),
) -> KueueReport:
    """Start Kueue on the running devcluster (idempotent); return once it admits."""
    with _exclusive(target):
        if _ready(target, ports):
            return KueueReport(already_running=True, ready_seconds=0.0, build_seconds=0.0)
        if adminapi.api_get(target, "/readyz")[0] != 200:
            raise errors.DevclusterError(
                f"the devcluster's API server ({target.server}) is not ready: run `devcluster up`"
            )
        build_seconds = build.build(build.KUEUE, log=target.state.log("build-kueue"))
        started = time.monotonic()
        deadline = started + timeout
        if not running(target):
            _start(target, ports)
        _wait_ready(target, ports, deadline=deadline)
        return KueueReport(
            already_running=False,
            ready_seconds=time.monotonic() - started,
            build_seconds=build_seconds,
        )


def _start(target: Target, ports: KueuePorts) -> None:
    # A pidfile of a dead manager (crash, reboot) would read as "exited" below.
    processes.stop_pidfile(target.state.pidfile(COMPONENT), grace_seconds=STOP_GRACE_SECONDS)
    gomanager.refuse_busy_ports((ports.webhook, ports.health), who="Kueue")
    cert_dir = _ensure_certs(target)
    config_path = state_dir(target) / "config.yaml"
    config_path.write_text(yaml.safe_dump(manager_config(cert_dir=cert_dir, ports=ports)))
    root = module_dir()
    apply(target, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
    definitions = crds(root)
    for crd in definitions:
        apply(target, crd)
    _wait_established(target, [c["metadata"]["name"] for c in definitions])
    manifests = list(yaml.safe_load_all((root / WEBHOOK_MANIFESTS_IN_MODULE).read_text()))
    for config in webhook_configurations(
        [m for m in manifests if m],
        url_base=f"https://127.0.0.1:{ports.webhook}",
        ca_bundle=(target.state.pki / "ca.crt").read_bytes(),
    ):
        apply(target, config)
    processes.spawn(
        name=COMPONENT,
        argv=manager_command(config_path=config_path, kubeconfig=target.state.admin_kubeconfig),
        log_path=target.state.log(COMPONENT),
        pidfile=target.state.pidfile(COMPONENT),
        env=dict(os.environ, TMPDIR=str(target.state.tmp)),
        cwd=target.state.root,
    )


def _wait_established(target: Target, names: list[str]) -> None:
    gomanager.wait_established(
        target, names, failure=lambda pending: f"Kueue CRDs not Established in 60 s: {pending}"
    )


def _wait_ready(target: Target, ports: KueuePorts, *, deadline: float) -> None:
    gomanager.wait_ready(
        target,
        component=COMPONENT,
        ready=lambda: gomanager.ready_probe(ports.health) and _webhooks_answer(target),
        deadline=deadline,
        exited="Kueue exited while starting",
        timed_out="timed out waiting for Kueue's webhooks",
    )


def down(target: Target) -> None:
    """Stop the manager by its PID; CRDs, queues and webhook configurations stay."""
    with _exclusive(target):
        processes.stop_pidfile(target.state.pidfile(COMPONENT), grace_seconds=STOP_GRACE_SECONDS)


# ------------------------------------------------------------------ queues


def ensure_queues(
    target: Target,
    *,
    namespace: str,
    quota: Mapping[str, str] = DEFAULT_QUOTA,
    cluster_queue_name: str = CLUSTER_QUEUE,
    local_queue_name: str = LOCAL_QUEUE,
) -> None:
    """Apply `default-flavor`, the ClusterQueue (with `quota`) and a LocalQueue in `namespace`."""
    apply(target, resource_flavor())
    apply(target, cluster_queue(name=cluster_queue_name, quota=quota))
    apply(
        target,
        local_queue(
            namespace=namespace, name=local_queue_name, cluster_queue_name=cluster_queue_name
        ),
    )


def set_quota(
    target: Target, quota: Mapping[str, str], *, cluster_queue_name: str = CLUSTER_QUEUE
) -> None:
    """Re-apply the ClusterQueue with `quota` (Kueue re-evaluates admitted and pending work)."""
    apply(target, cluster_queue(name=cluster_queue_name, quota=quota))
