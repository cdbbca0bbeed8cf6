"""The quickstart demo on the devcluster, and the same steps for the tests.

Cairn-specific, so it lives with the tests, not in the devcluster (which
imports nothing of Cairn): the fixtures in ``tests/conftest.py``, the e2e
tests and ``bench/operator_scale.py`` use its helpers (install the CRD and
the status policy, start and stop the one operator process, run a job).

`python -m tests.demo`, from the repository root (the README's first
command, `scripts/demo`, runs it): brings the devcluster up, installs the CRD, starts the operator as a tracked local
process, creates the S3 bucket and the credentials Secret, applies
`examples/quickstart.yaml`, and prints a `kubectl get tj` row every time the
job's state changes — through commits and uploads, a rank deliberately killed
with SIGKILL, the gang restart resuming from the last committed step, and
Succeeded. It ends with what is in S3 and how to clean up.
"""

import argparse
import dataclasses
import datetime
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import urllib3
import yaml
from awscrt import checksums
from kubernetes import client, config
from kubernetes.client.rest import ApiException

from cairn.api import checkpointspec
from cairn.api import manifest as manifest_mod
from cairn.devcluster import build, cluster, controlplane, errors, network, processes

REPO = pathlib.Path(__file__).resolve().parents[1]
CRD_PATH = REPO / "crds" / "cairn.dev_trainingjobs.yaml"
STATUS_POLICY_PATH = REPO / "crds" / "cairn.dev_status-policy.yaml"
"""The ValidatingAdmissionPolicy + binding that confine the trainer's status
writes; installed with the CRD, as the chart does."""
QUICKSTART = REPO / "examples" / "quickstart.yaml"
QUICKSTART_RAY = REPO / "examples" / "quickstart-ray.yaml"
EXAMPLES = {"torchrun": QUICKSTART, "ray": QUICKSTART_RAY}
"""The quickstart per ``--runtime``."""
RESTRICTED_NAMESPACE_LABELS = {"pod-security.kubernetes.io/enforce": "restricted"}
NAMESPACE = "cairn-demo"
GROUP, VERSION, PLURAL = "cairn.dev", "v1alpha1", "trainingjobs"
OPERATOR = "operator"
JOB_TIMEOUT_SECONDS = 900.0
TRANSIENT_SECONDS = 120.0
"""How long a call to the API server is retried while it does not answer."""
T = TypeVar("T")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """What one line of progress shows (the printer columns that matter)."""

    phase: str
    step: int | None
    committed: int | None
    uploaded: int | None
    restarts: int
    attempt: int | None
    resumed_from: int | None

    @classmethod
    def of(cls, job: dict[str, Any]) -> "Row":
        status = job.get("status") or {}
        ckpts = status.get("checkpoints") or {}
        return cls(
            phase=str(status.get("phase") or "-"),
            step=status.get("step"),
            committed=(ckpts.get("lastCommitted") or {}).get("step"),
            uploaded=(ckpts.get("lastUploaded") or {}).get("step"),
            restarts=int(status.get("restarts") or 0),
            attempt=status.get("attempt"),
            resumed_from=(ckpts.get("resumedFrom") or {}).get("step"),
        )

    def line(self) -> str:
        def show(value: object) -> str:
            return "-" if value is None else str(value)

        return (
            f"{self.phase:<11} step={show(self.step):>3}  committed={show(self.committed):>3}  "
            f"uploaded={show(self.uploaded):>3}  restarts={self.restarts}  "
            f"attempt={show(self.attempt)}  resumedFrom={show(self.resumed_from)}"
        )


def say(text: str) -> None:
    stamp = datetime.datetime.now().strftime("%H:%M:%S")
    print(f"[{stamp}] {text}", flush=True)


def install_crd(api_client: client.ApiClient) -> None:
    ext = client.ApiextensionsV1Api(api_client)
    body = yaml.safe_load(CRD_PATH.read_text())
    name = body["metadata"]["name"]
    try:
        current = ext.read_custom_resource_definition(name)
        body["metadata"]["resourceVersion"] = current.metadata.resource_version
        ext.replace_custom_resource_definition(name, body)
    except ApiException as exc:
        if exc.status != 404:
            raise
        ext.create_custom_resource_definition(body)
    install_status_policy(api_client)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        got = ext.read_custom_resource_definition(name)
        if any(c.type == "Established" and c.status == "True" for c in got.status.conditions or []):
            return
        time.sleep(0.5)
    raise errors.DevclusterError(f"CRD {name} not established within 60 s")


def install_status_policy(api_client: client.ApiClient) -> None:
    """Create or replace the status policy and its binding (crds/, generated)."""
    admission = client.AdmissionregistrationV1Api(api_client)
    for body in yaml.safe_load_all(STATUS_POLICY_PATH.read_text()):
        kind, name = body["kind"], body["metadata"]["name"]
        if kind == "ValidatingAdmissionPolicy":
            read, create, replace = (
                admission.read_validating_admission_policy,
                admission.create_validating_admission_policy,
                admission.replace_validating_admission_policy,
            )
        else:
            read, create, replace = (
                admission.read_validating_admission_policy_binding,
                admission.create_validating_admission_policy_binding,
                admission.replace_validating_admission_policy_binding,
            )
        try:
            body["metadata"]["resourceVersion"] = read(name).metadata.resource_version
            replace(name, body)
        except ApiException as exc:
            if exc.status != 404:
                raise
            body["metadata"].pop("resourceVersion", None)
            create(body)


def operator_running(target: cluster.Cluster) -> bool:
    tracked = processes.read_pidfile(target.state.pidfile(OPERATOR))
    return tracked is not None and processes.is_alive(tracked)


def start_operator(target: cluster.Cluster) -> None:
    """The operator as a local process (what the chart's Deployment runs), tracked by PID."""
    if operator_running(target):
        return
    env = dict(os.environ)
    env["KUBECONFIG"] = str(target.state.admin_kubeconfig)
    env["TMPDIR"] = str(target.state.tmp)
    # As a production install would: the operator may call only the cluster's
    # own S3 (chart value s3.endpointAllowList), never its own identity.
    env["CAIRN_S3_ENDPOINT_ALLOWLIST"] = f"{target.s3_endpoint},{target.s3_pod_endpoint}"
    # The devcluster's Service and pod ranges: refused as job endpoints unless listed.
    pods = f"{network.GATEWAY}/{network.PREFIX_LENGTH}"
    env["CAIRN_S3_CLUSTER_NETWORKS"] = f"{controlplane.SERVICE_CIDR},{pods}"
    argv = [sys.executable, "-m", "cairn.operator", "--all-namespaces"]
    processes.spawn(
        name=OPERATOR,
        argv=argv,
        log_path=target.state.log(OPERATOR),
        pidfile=target.state.pidfile(OPERATOR),
        env=env,
    )


def stop_operator(target: cluster.Cluster) -> None:
    processes.stop_pidfile(target.state.pidfile(OPERATOR), grace_seconds=10.0)


def prepare_namespace(
    *, api_client: client.ApiClient, target: cluster.Cluster, namespace: str, bucket: str
) -> None:
    """Namespace (enforcing the restricted Pod Security Standard, which Cairn's
    pods meet), the S3 bucket, and the credentials Secret the job refers to."""
    core = client.CoreV1Api(api_client)
    meta = client.V1ObjectMeta(name=namespace, labels=dict(RESTRICTED_NAMESPACE_LABELS))
    try:
        core.create_namespace(client.V1Namespace(metadata=meta))
    except ApiException as exc:
        if exc.status != 409:
            raise
        core.patch_namespace(namespace, {"metadata": {"labels": RESTRICTED_NAMESPACE_LABELS}})
    creds = target.s3_credentials()
    s3 = target.s3_client()
    existing = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
    if bucket not in existing:
        s3.create_bucket(Bucket=bucket)
    secret = client.V1Secret(
        metadata=client.V1ObjectMeta(name="cairn-demo-s3"),
        string_data={
            "AWS_ACCESS_KEY_ID": creds.access_key,
            "AWS_SECRET_ACCESS_KEY": creds.secret_key,
        },
    )
    try:
        core.create_namespaced_secret(namespace, secret)
    except ApiException as exc:
        if exc.status != 409:
            raise
        core.replace_namespaced_secret("cairn-demo-s3", namespace, secret)


def quickstart_manifest(
    target: cluster.Cluster, *, name: str, path: pathlib.Path = QUICKSTART
) -> dict[str, Any]:
    """examples/quickstart.yaml (or ``path``) with the S3 endpoint as pods reach it here."""
    body: dict[str, Any] = yaml.safe_load(path.read_text())
    body["metadata"]["name"] = name
    body["spec"]["checkpoint"]["upload"]["endpoint"] = target.s3_pod_endpoint
    return body


def _transient(exc: Exception) -> bool:
    """An API error worth retrying: no answer (server restarting), 429 or 5xx."""
    if isinstance(exc, ApiException):
        return exc.status in (None, 0, 429) or exc.status >= 500
    return isinstance(exc, urllib3.exceptions.HTTPError | OSError)


def retrying(call: Callable[[], T], *, seconds: float = TRANSIENT_SECONDS) -> T:
    """`call()`, retried while the API server is briefly away (restarts, overload)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return call()
        except Exception as exc:
            if not _transient(exc) or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def apiserver_request_totals(api_client: client.ApiClient) -> dict[str, float]:
    """The API server's `apiserver_request_total` samples ({labels: count}), plus
    `process_start_time_seconds` under that name (a restart resets the counters)."""
    response = retrying(
        lambda: api_client.call_api(
            "/metrics",
            "GET",
            auth_settings=["BearerToken"],
            _preload_content=False,
            _return_http_data_only=True,
        )
    )
    samples: dict[str, float] = {}
    for line in response.data.decode().splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("apiserver_request_total{") or name == "process_start_time_seconds":
            samples[name] = float(value)
    return samples


def get_job(custom: client.CustomObjectsApi, namespace: str, name: str) -> dict[str, Any]:
    job: dict[str, Any] = retrying(
        lambda: custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    )
    return job


def rank_pid(core: client.CoreV1Api, *, namespace: str, job: str, rank: int) -> int | None:
    """The PID of the running trainer process of `rank` (devcluster pods), or None."""
    pods = retrying(
        lambda: core.list_namespaced_pod(
            namespace, label_selector=f"cairn.dev/job-name={job},cairn.dev/rank={rank}"
        )
    ).items
    running = [p for p in pods if p.status.phase == "Running" and p.status.container_statuses]
    if not running:
        return None
    container_id = running[0].status.container_statuses[0].container_id or ""
    if not container_id.startswith("cairn://"):
        return None
    return int(container_id.removeprefix("cairn://"))


def kill_rank(core: client.CoreV1Api, *, namespace: str, job: str, rank: int) -> int | None:
    """SIGKILL the trainer process of `rank` in the job's current attempt; its PID."""
    pid = rank_pid(core, namespace=namespace, job=job, rank=rank)
    if pid is None:
        return None
    os.kill(pid, signal.SIGKILL)
    return pid


def run_job(
    *,
    api_client: client.ApiClient,
    namespace: str,
    body: dict[str, Any],
    kill_rank_after_commit: int | None,
    on_row: Callable[[Row], None],
    timeout: float = JOB_TIMEOUT_SECONDS,
    on_poll: Callable[[dict[str, Any]], None] | None = None,
    poll_seconds: float = 1.0,
) -> dict[str, Any]:
    """Apply the TrainingJob `body`, follow it to the end, maybe kill a rank once.

    `on_poll` sees the job as read on every poll (every `poll_seconds`) until
    it is Succeeded or Failed: tests use it to suspend, resume or kill.
    """
    name = body["metadata"]["name"]
    custom = client.CustomObjectsApi(api_client)
    core = client.CoreV1Api(api_client)
    try:
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            get_job(custom, namespace, name)
            time.sleep(0.5)
    except ApiException as exc:
        if exc.status != 404:
            raise
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    last: Row | None = None
    killed = False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = get_job(custom, namespace, name)
        row = Row.of(job)
        if row != last:
            on_row(row)
            last = row
        if row.phase in ("Succeeded", "Failed"):
            return job
        if on_poll is not None:
            on_poll(job)
        ready_to_kill = (
            kill_rank_after_commit is not None
            and not killed
            and row.phase == "Running"
            and (row.committed or 0) >= kill_rank_after_commit
        )
        if ready_to_kill:
            pid = kill_rank(core, namespace=namespace, job=name, rank=1)
            if pid is not None:
                killed = True
                say(f"killed rank 1 (pid {pid}) with SIGKILL, mid-training")
        time.sleep(poll_seconds)
    raise errors.DevclusterError(f"TrainingJob {namespace}/{name} did not finish in {timeout:.0f}s")


def clear_prefix(target: cluster.Cluster, *, bucket: str, prefix: str) -> int:
    """Delete what a previous demo run left under the prefix; the count deleted."""
    s3 = target.s3_client()
    keys = [
        item["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for item in page.get("Contents", [])
    ]
    # Manifests first, so a half-cleared step is never taken for a committed one.
    keys.sort(key=lambda k: not k.endswith("manifest.json"))
    for key in keys:
        s3.delete_object(Bucket=bucket, Key=key)
    return len(keys)


def s3_listing(target: cluster.Cluster, *, bucket: str, prefix: str) -> dict[str, list[str]]:
    """Step folder → object names (relative to the folder) under s3://bucket/prefix.

    Only `step-<N>` folders: the prefix's `.cairn/` (owner claim, moved-aside
    manifests) is bookkeeping, not a checkpoint step.
    """
    s3 = target.s3_client()
    out: dict[str, list[str]] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            rel = item["Key"][len(prefix) :].lstrip("/")
            folder, _, rest = rel.partition("/")
            if manifest_mod.parse_step_dir_name(folder) is not None:
                out.setdefault(folder, []).append(rest)
    return out


def assert_s3_steps_verify(
    *,
    custom: client.CustomObjectsApi,
    target: cluster.Cluster,
    namespace: str,
    name: str,
    bucket: str,
    prefix: str,
    final_step: int,
    timeout: float = 60.0,
) -> dict[str, list[str]]:
    """Once the operator's S3 pass has settled: the final step verified and
    uploaded; the step folders exactly ``status.storage.remoteSteps``; each
    with a manifest of its own step whose every file's size and CRC32C match
    what S3 holds. The listing.

    The pass runs beside the lifecycle: it can still be deleting a rotated step
    (manifest first, then its data) when the job shows Succeeded, and a listing
    taken then shows a folder without a manifest that is half deleted, not
    half uploaded (seen in a full run: ``step-000000015 has no manifest``).
    Settled: the final step verified and the listing's step folders exactly
    ``status.storage.remoteSteps`` (patched after the pass's deletions); at
    ``timeout`` the last listing is judged, so the assertions show what is there.
    """
    deadline = time.monotonic() + timeout
    while True:
        storage = (get_job(custom, namespace, name).get("status") or {}).get("storage") or {}
        listing = s3_listing(target, bucket=bucket, prefix=prefix)
        steps = sorted(s for f in listing if (s := manifest_mod.parse_step_dir_name(f)) is not None)
        settled = storage.get("verifiedStep") == final_step and steps == storage.get("remoteSteps")
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert listing, "nothing uploaded"
    assert storage.get("verifiedStep") == final_step, storage
    assert sorted(listing) == [manifest_mod.step_dir_name(s) for s in storage["remoteSteps"]], (
        storage,
        {folder: sorted(objects) for folder, objects in sorted(listing.items())},
    )
    assert manifest_mod.step_dir_name(final_step) in listing, sorted(listing)
    s3 = target.s3_client()
    for folder, objects in listing.items():
        assert manifest_mod.MANIFEST_NAME in objects, f"{folder} has no manifest: {sorted(objects)}"
        key = f"{prefix}/{folder}/{manifest_mod.MANIFEST_NAME}"
        parsed = manifest_mod.parse_manifest(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        assert parsed.step == manifest_mod.parse_step_dir_name(folder), (folder, parsed.step)
        for entry in parsed.files:
            data_key = f"{prefix}/{folder}/{parsed.data_key(entry.path)}"
            body = s3.get_object(Bucket=bucket, Key=data_key)["Body"].read()
            assert len(body) == entry.size, (data_key, len(body), entry.size)
            assert f"{checksums.crc32c(body):08x}" == entry.crc32c, data_key
    return listing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/demo", description=__doc__)
    parser.add_argument("--name", default=None, help="default: the example's name")
    parser.add_argument("--no-kill", action="store_true", help="do not kill a rank")
    parser.add_argument(
        "--runtime",
        choices=sorted(EXAMPLES),
        default="torchrun",
        help="ray: examples/quickstart-ray.yaml (a Ray head and a worker pod; the killed "
        "rank is the worker pod's process, so the gang restarts)",
    )
    args = parser.parse_args(argv)
    example = EXAMPLES[args.runtime]
    target = cluster.Cluster.default()
    try:
        say("bringing up the devcluster")
        report = cluster.up(target)
        say(
            f"devcluster ready ({'already running' if report.already_running else f'{report.ready_seconds:.1f}s'})"
        )
        api_client = config.new_client_from_config(config_file=str(target.state.admin_kubeconfig))
        install_crd(api_client)
        say("CRD trainingjobs.cairn.dev installed")
        manifest = yaml.safe_load(example.read_text())
        args.name = args.name or manifest["metadata"]["name"]
        uri = manifest["spec"]["checkpoint"]["upload"]["uri"]
        bucket, prefix = checkpointspec.split_s3_uri(uri)
        prepare_namespace(api_client=api_client, target=target, namespace=NAMESPACE, bucket=bucket)
        cleared = clear_prefix(target, bucket=bucket, prefix=prefix)
        if cleared:
            say(f"removed {cleared} objects of a previous demo run from s3://{bucket}/{prefix}")
        start_operator(target)
        say(f"operator running (log: {target.state.log(OPERATOR)})")
        say(f"applying examples/{example.name} as {NAMESPACE}/{args.name}")
        started = time.monotonic()
        job = run_job(
            api_client=api_client,
            namespace=NAMESPACE,
            body=quickstart_manifest(target, name=args.name, path=example),
            kill_rank_after_commit=None if args.no_kill else 10,
            on_row=lambda row: say(row.line()),
        )
        say(f"job finished: {Row.of(job).phase} in {time.monotonic() - started:.0f}s")
        kubectl = build.KUBERNETES.binary("kubectl")
        env = dict(os.environ, KUBECONFIG=str(target.state.admin_kubeconfig))
        subprocess.run(
            [str(kubectl), "-n", NAMESPACE, "get", "tj", "-o", "wide"], env=env, check=False
        )
        job_prefix = f"{prefix}".strip("/")
        listing = s3_listing(target, bucket=bucket, prefix=job_prefix)
        say(f"in s3://{bucket}/{job_prefix}:")
        for folder, objects in sorted(listing.items()):
            print(
                f"    {folder}/  ({len(objects)} objects, manifest: {'manifest.json' in objects})"
            )
        print()
        print("Clean up:")
        print(
            f"    kubectl -n {NAMESPACE} delete tj {args.name}    # checkpoints in S3 are retained (onDelete: Retain)"
        )
        print(
            "    devcluster down                             # stops the operator, the cluster and S3"
        )
        print(f'Use kubectl: eval "$({pathlib.Path(sys.executable).parent / "devcluster"} env)"')
        return 0 if Row.of(job).phase == "Succeeded" else 1
    except errors.DevclusterError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
