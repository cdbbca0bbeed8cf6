"""`devcluster up | down | status | env`: the local cluster's lifecycle.

`up` is idempotent: it builds what is missing, creates key material, checks
ports, then starts etcd, kube-apiserver, kube-controller-manager,
kube-scheduler, the S3 server and the node agent, each tracked by a pidfile,
and waits (bounded) until the API is ready, the nodes are Ready and the
`default` ServiceAccount exists; `up(with_kueue=True)` then starts Kueue
(`kueue.up`). `down` stops exactly those processes (and the on-demand ones:
the operator, Kueue) by PID and removes what they left outside the state
directory.
"""

import contextlib
import dataclasses
import fcntl
import json
import os
import pathlib
import shlex
import shutil
import socket
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from cairn.devcluster import (
    adminapi,
    build,
    controlplane,
    errors,
    kueue,
    network,
    paths,
    pki,
    processes,
    s3,
)
from cairn.devcluster.agent import volumes as agent_volumes

# Start order; `down` stops in reverse.
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "s3", "agent")
DEFAULT_NODES = (
    "devcluster-node-0:cpu=8,memory=16Gi,pods=110,nvidia.com/gpu=2",
    "devcluster-node-1:cpu=8,memory=16Gi,pods=110",
)
STOP_GRACE_SECONDS = {"s3": 15.0, "agent": 20.0}
READY_TIMEOUT_SECONDS = 180.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """A devcluster's state directory and ports: everything needed to find it."""

    state: paths.StatePaths
    ports: controlplane.Ports = dataclasses.field(default_factory=controlplane.Ports)
    nodes: tuple[str, ...] = DEFAULT_NODES

    @classmethod
    def default(cls) -> "Cluster":
        return cls(state=paths.StatePaths(root=paths.default_state_dir()))

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports.apiserver}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports.s3}"

    @property
    def s3_pod_endpoint(self) -> str:
        """The S3 endpoint as pods (in their own network namespaces) reach it."""
        return f"http://{controlplane.POD_GATEWAY}:{self.ports.s3}"

    @property
    def s3_ports(self) -> s3.S3Ports:
        return s3.S3Ports(s3=self.ports.s3)

    def s3_credentials(self) -> s3.S3Credentials:
        return s3.ensure_credentials(self.state.s3_data)

    def kueue_up(self, *, timeout: float = kueue.READY_TIMEOUT_SECONDS) -> kueue.KueueReport:
        """Start Kueue on this running cluster (idempotent, bounded); see `kueue.up`."""
        return kueue.up(self, timeout=timeout)

    def s3_client(self) -> Any:
        """A boto3 S3 client of this cluster's server, with its keys (from this host)."""
        import boto3  # only the callers that talk to S3 pay for it

        creds = self.s3_credentials()
        return boto3.client(
            "s3",
            endpoint_url=self.s3_endpoint,
            aws_access_key_id=creds.access_key,
            aws_secret_access_key=creds.secret_key,
            region_name="us-east-1",
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class UpReport:
    build_seconds: dict[str, float]
    ready_seconds: float
    already_running: bool
    kueue_report: kueue.KueueReport | None = None


def _tracked(cluster: Cluster) -> dict[str, processes.Tracked | None]:
    return {c: processes.read_pidfile(cluster.state.pidfile(c)) for c in COMPONENTS}


def running_components(cluster: Cluster) -> dict[str, bool]:
    return {
        name: tracked is not None and processes.is_alive(tracked)
        for name, tracked in _tracked(cluster).items()
    }


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def _check_ports(cluster: Cluster) -> None:
    wanted = list(cluster.ports.control_plane) + list(cluster.s3_ports.all)
    wanted += [cluster.ports.kubelet_base + i for i in range(len(cluster.nodes))]
    busy = [p for p in wanted if _port_in_use(p)]
    if busy:
        raise errors.DevclusterError(
            f"port(s) {', '.join(map(str, busy))} already in use by another process: stop it, "
            f"or run `devcluster down` if it is a devcluster from another state dir"
        )


def admin_ssl_context(cluster: Cluster) -> ssl.SSLContext:
    return adminapi.admin_ssl_context(cluster)


def api_get(cluster: Cluster, path: str, *, timeout: float = 5.0) -> tuple[int, bytes]:
    """GET a path of the API server as the admin; (status, body), status 0 if unreachable."""
    return adminapi.api_get(cluster, path, timeout=timeout)


def _wait(
    what: str, predicate: Callable[[], bool], *, deadline: float, cluster: Cluster, log: str
) -> None:
    while time.monotonic() < deadline:
        if predicate():
            return
        for name, alive in running_components(cluster).items():
            if not alive and name in _started_so_far(cluster):
                raise errors.DevclusterError(
                    f"{name} exited while waiting for {what}; see {cluster.state.log(name)}"
                )
        time.sleep(0.25)
    raise errors.DevclusterError(f"timed out waiting for {what}; see {cluster.state.log(log)}")


def _started_so_far(cluster: Cluster) -> set[str]:
    return {c for c in COMPONENTS if cluster.state.pidfile(c).exists()}


def _nodes_ready(cluster: Cluster) -> bool:
    status, body = api_get(cluster, "/api/v1/nodes")
    if status != 200:
        return False
    items = json.loads(body).get("items", [])
    ready = {
        item["metadata"]["name"]
        for item in items
        for cond in item.get("status", {}).get("conditions", [])
        if cond.get("type") == "Ready" and cond.get("status") == "True"
    }
    return all(spec.split(":", 1)[0] in ready for spec in cluster.nodes)


def _s3_ready(cluster: Cluster) -> bool:
    try:
        with urllib.request.urlopen(cluster.s3_endpoint + "/status", timeout=2) as resp:
            return int(resp.status) < 500
    except urllib.error.HTTPError as exc:
        return exc.code < 500
    except (urllib.error.URLError, OSError):
        return False


def _write_kubeconfigs(cluster: Cluster) -> None:
    for client in (pki.ADMIN, pki.CONTROLLER_MANAGER, pki.SCHEDULER):
        component = "admin" if client is pki.ADMIN else client.file_stem
        target = (
            cluster.state.admin_kubeconfig
            if client is pki.ADMIN
            else cluster.state.kubeconfig(component)
        )
        target.write_text(
            controlplane.kubeconfig(
                server=cluster.server,
                pki=cluster.state.pki,
                client_stem=client.file_stem,
                user=client.user,
            )
        )
        target.chmod(0o600)


def _server_env(cluster: Cluster) -> dict[str, str]:
    env = dict(os.environ)
    env["TMPDIR"] = str(cluster.state.tmp)
    return env


def _spawn(cluster: Cluster, name: str, argv: list[str]) -> None:
    processes.spawn(
        name=name,
        argv=argv,
        log_path=cluster.state.log(name),
        pidfile=cluster.state.pidfile(name),
        env=_server_env(cluster),
        cwd=cluster.state.root,
    )


def _agent_command(cluster: Cluster) -> list[str]:
    argv = [sys.executable, "-m", "cairn.devcluster.agent"]
    argv += ["--state-dir", str(cluster.state.root)]
    argv += ["--kubeconfig", str(cluster.state.admin_kubeconfig)]
    argv += ["--kubelet-port-base", str(cluster.ports.kubelet_base)]
    for node in cluster.nodes:
        argv += ["--node", node]
    return argv


def _check_not_stale(cluster: Cluster) -> None:
    info = cluster.state.info_file
    if not info.exists():
        return
    recorded = json.loads(info.read_text())
    if recorded.get("kubernetes") != build.KUBERNETES_VERSION:
        raise errors.DevclusterError(
            f"state dir {cluster.state.root} belongs to Kubernetes "
            f"{recorded.get('kubernetes')}, not {build.KUBERNETES_VERSION}: run "
            f"`devcluster down --purge` to start afresh"
        )


@contextlib.contextmanager
def _exclusive(cluster: Cluster) -> Iterator[None]:
    """Serialize up/down across processes: a second `up` waits, then finds it running."""
    cluster.state.root.mkdir(parents=True, exist_ok=True)
    with (cluster.state.root / ".lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def up(cluster: Cluster, *, with_kueue: bool = False) -> UpReport:
    with _exclusive(cluster):
        try:
            report = _up(cluster)
        except BaseException:
            # Leave nothing half-started behind a failed or interrupted `up`.
            _down(cluster)
            raise
    if with_kueue:
        # Outside the cluster's lock and its clean-up: a Kueue that fails to
        # start leaves the running cluster as it was, with the error to read.
        report = dataclasses.replace(report, kueue_report=kueue.up(cluster))
    return report


def _up(cluster: Cluster) -> UpReport:
    state = cluster.state
    alive = running_components(cluster)
    if all(alive.values()) and _nodes_ready(cluster):
        return UpReport(build_seconds={}, ready_seconds=0.0, already_running=True)
    # Half up (a crash, ^C during up) or left over from before a reboot (pidfiles
    # of dead processes, network namespaces): start from a clean slate. A stale
    # pidfile would otherwise read as "component exited" while waiting.
    _down(cluster)
    _check_not_stale(cluster)
    for directory in (state.root, state.logs, state.pids, state.tmp):
        directory.mkdir(parents=True, exist_ok=True)
    build_seconds = build.build_all(log_dir=state.logs)
    _check_ports(cluster)
    started = time.monotonic()
    deadline = started + READY_TIMEOUT_SECONDS
    pki.ensure(state.pki)
    _write_kubeconfigs(cluster)
    # Claimed before anything host-wide exists, so a failed `up` still cleans it.
    state.host_claim.touch()
    network.ensure_bridge()
    state.info_file.write_text(
        json.dumps(
            {
                "kubernetes": build.KUBERNETES_VERSION,
                "etcd": build.ETCD_VERSION,
                "server": cluster.server,
                "s3": cluster.s3_endpoint,
            }
        )
    )

    _spawn(cluster, "etcd", controlplane.etcd_command(state=state, ports=cluster.ports))
    _spawn(cluster, "s3", _s3_command(cluster))
    _spawn(
        cluster, "kube-apiserver", controlplane.apiserver_command(state=state, ports=cluster.ports)
    )
    _wait(
        "the API server's /readyz",
        lambda: api_get(cluster, "/readyz")[0] == 200,
        deadline=deadline,
        cluster=cluster,
        log="kube-apiserver",
    )
    _spawn(cluster, "kube-controller-manager", controlplane.controller_manager_command(state=state))
    _spawn(cluster, "kube-scheduler", controlplane.scheduler_command(state=state))
    _spawn(cluster, "agent", _agent_command(cluster))
    _wait("S3", lambda: _s3_ready(cluster), deadline=deadline, cluster=cluster, log="s3")
    _wait(
        "the default ServiceAccount (controller-manager)",
        lambda: api_get(cluster, "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200,
        deadline=deadline,
        cluster=cluster,
        log="kube-controller-manager",
    )
    _wait(
        "Ready nodes",
        lambda: _nodes_ready(cluster),
        deadline=deadline,
        cluster=cluster,
        log="agent",
    )
    _write_env_file(cluster)
    return UpReport(
        build_seconds=build_seconds,
        ready_seconds=time.monotonic() - started,
        already_running=False,
    )


def _s3_command(cluster: Cluster) -> list[str]:
    # Bound to all addresses so pods reach it through the bridge gateway.
    return s3.command(
        data_dir=cluster.state.s3_data,
        log_dir=cluster.state.logs / "s3",
        ports=cluster.s3_ports,
        bind="0.0.0.0",
    )


# Started on demand (the demo, e2e tests, `up --with-kueue`), stopped by `down`
# first when present.
OPTIONAL_COMPONENTS = ("operator", kueue.COMPONENT)


def optional_components(cluster: Cluster) -> dict[str, bool]:
    """Which on-demand components run; they never make the cluster count as down."""
    return {
        name: tracked is not None and processes.is_alive(tracked)
        for name in OPTIONAL_COMPONENTS
        for tracked in [processes.read_pidfile(cluster.state.pidfile(name))]
    }


def down(cluster: Cluster, *, purge: bool = False) -> None:
    with _exclusive(cluster):
        _down(cluster, purge=purge)


def _down(cluster: Cluster, *, purge: bool = False) -> None:
    for name in (*OPTIONAL_COMPONENTS, *reversed(COMPONENTS)):
        processes.stop_pidfile(
            cluster.state.pidfile(name), grace_seconds=STOP_GRACE_SECONDS.get(name, 10.0)
        )
    # The bridge, namespaces and /tmp sockets are host-wide: a `down` (or the
    # clean-slate step of `up`) for a state dir that never started them, e.g.
    # a mistyped or test state dir, must leave a running devcluster's alone.
    # A killed agent leaves its pods' memory-backed emptyDirs (tmpfs) mounted.
    if cluster.state.root.exists():
        agent_volumes.release(cluster.state.root)
    if cluster.state.host_claim.exists():
        network.remove_all()
        for sock in s3.stray_sockets(cluster.s3_ports):
            sock.unlink(missing_ok=True)
        cluster.state.host_claim.unlink()
    cluster.state.env_file.unlink(missing_ok=True)
    if purge and cluster.state.root.exists():
        _purge(cluster.state.root)


def _purge(root: pathlib.Path) -> None:
    shutil.rmtree(root)


def env_lines(cluster: Cluster) -> list[str]:
    """Pure apart from reading the generated S3 keys: shell exports for clients."""
    creds = cluster.s3_credentials()
    exports = {
        "KUBECONFIG": str(cluster.state.admin_kubeconfig),
        "PATH": f"{build.KUBERNETES.bin_dir}:{os.environ.get('PATH', '')}",
        "AWS_ENDPOINT_URL_S3": cluster.s3_endpoint,
        "AWS_ACCESS_KEY_ID": creds.access_key,
        "AWS_SECRET_ACCESS_KEY": creds.secret_key,
        "AWS_REGION": s3.REGION,
        "CAIRN_DEVCLUSTER_STATE": str(cluster.state.root),
    }
    return [f"export {k}={shlex.quote(v)}" for k, v in exports.items()]


def _write_env_file(cluster: Cluster) -> None:
    cluster.state.env_file.write_text("\n".join(env_lines(cluster)) + "\n")
    cluster.state.env_file.chmod(0o600)
