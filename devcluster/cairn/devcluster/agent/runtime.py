"""One worker thread per pod: namespaces, volumes, processes, restarts, status.

The worker owns its pod from binding to deletion: it creates the pod's
network namespace, materializes volumes, runs init containers in order and
then every container as a process (through `launch`), applies the pod's
`restartPolicy` with the kubelet's back-off, reports status through the
`pods/status` subresource, and on deletion sends SIGTERM, waits the grace
period, sends SIGKILL, and removes the pod object as the kubelet does.
"""

import contextlib
import dataclasses
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from cairn.devcluster import network
from cairn.devcluster.agent import hosts, podspec, podstatus, volumes

log = logging.getLogger("cairn.devcluster.agent")
Obj = dict[str, Any]
POLL_SECONDS = 0.2
SIDECAR_STOP_SECONDS = 5.0
"""Grace for native sidecars once the app containers finished."""
MAX_BACKOFF_SECONDS = 300.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Context:
    """What every worker shares: the API, paths, and the agent's callbacks."""

    core: client.CoreV1Api
    state_dir: pathlib.Path
    backoff_base_seconds: float
    allocate_index: Callable[[], int]
    release_index: Callable[[int], None]
    hosts_changed: Callable[[], None]
    hosts_records: Callable[[], list[str]]
    stopping: threading.Event
    """Set at agent shutdown: workers start nothing more and leave their loops."""
    network_attached: Callable[[Obj, str, str], None] = lambda pod, netns, address: None
    """(pod, netns, address) once the pod's namespace exists, before any container
    starts: the agent loads the pod's NetworkPolicy rules there (`netfilter`)."""
    network_detached: Callable[[Obj, str], None] = lambda pod, netns: None


class PodWorker:
    def __init__(self, *, pod: Obj, ctx: Context) -> None:
        self.ctx = ctx
        self._pod = pod
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.uid: str = pod["metadata"]["uid"]
        self.namespace: str = pod["metadata"]["namespace"]
        self.name: str = pod["metadata"]["name"]
        self.dir = ctx.state_dir / "pods" / f"{self.namespace}_{self.name}_{self.uid}"
        self.netns_index: int | None = None
        self.ip = ""
        self.finished = False
        self.address: hosts.PodAddress | None = None
        self._start_time = podstatus.now()
        self._last_status: Obj | None = None  # as computed
        self._last_sent: Obj | None = None  # as patched, with transition times
        self._containers: list[podstatus.Container] = []
        self._net_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"pod-{self.name}", daemon=True)

    # ------------------------------------------------------------- interface
    def start(self) -> None:
        self._thread.start()

    def update(self, pod: Obj) -> None:
        with self._lock:
            self._pod = pod
        self._wake.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def signal_all(self, sig: signal.Signals) -> None:
        """Agent shutdown: signal every live process group of this pod."""
        for container in self._containers:
            _signal(container, sig)

    def container_running(self, name: str) -> bool:
        """The named container's process is alive now (a follow of its log ends with it)."""
        return any(
            c.spec.get("name") == name and c.process is not None and c.process.poll() is None
            for c in self._containers
        )

    def live_processes(self) -> bool:
        return any(c.process and c.process.poll() is None for c in self._containers)

    def release_network(self) -> None:
        """Agent shutdown: remove the namespace, veth and /etc/netns entry."""
        self._teardown_network()

    def write_hosts(self, records: list[str]) -> None:
        if self.netns_index is None or self.address is None:
            return
        path = network.ETC_NETNS / network.netns_name(self.netns_index) / "hosts"
        if path.parent.exists():
            network.write_in_place(
                path, hosts.hosts_file(own=self.address, cluster_records=records)
            )

    # ------------------------------------------------------------- the loop
    @property
    def pod(self) -> Obj:
        with self._lock:
            return self._pod

    def _run(self) -> None:
        try:
            self._lifecycle()
        except Exception:
            log.exception("pod worker crashed", extra={"pod": f"{self.namespace}/{self.name}"})
            with contextlib.suppress(Exception):
                self._terminate(grace=0)
        finally:
            self._teardown_network()
            volumes.release(self.dir)  # memory-backed emptyDirs end with the pod
            self.finished = True

    def _lifecycle(self) -> None:
        if not self._setup():
            if not self.ctx.stopping.is_set():
                self._finish_deletion()
            return
        spec = self.pod["spec"]
        inits = [podstatus.Container(spec=c, init=True) for c in spec.get("initContainers") or []]
        mains = [podstatus.Container(spec=c, init=False) for c in spec.get("containers") or []]
        self._containers = inits + mains
        policy = spec.get("restartPolicy", "Always")
        token_refresh = volumes.token_refresh_seconds(self.pod)
        next_refresh = time.monotonic() + token_refresh
        while not self.ctx.stopping.is_set():
            if self.pod["metadata"].get("deletionTimestamp"):
                self._terminate(grace=self._grace())
                self._finish_deletion()
                return
            if time.monotonic() >= next_refresh:
                with contextlib.suppress(Exception):
                    volumes.refresh_projected(
                        core=self.ctx.core, pod=self.pod, pod_dir=self.dir, pod_ip=self.ip
                    )
                next_refresh = time.monotonic() + token_refresh
            for sidecar in inits:
                if podstatus.is_sidecar(sidecar) and podstatus.started(sidecar):
                    self._step(sidecar, policy="Always")
            pending_init = next((c for c in inits if podstatus.blocks_start(c)), None)
            if pending_init is not None and podstatus.is_sidecar(pending_init):
                self._step(pending_init, policy="Always")
            elif pending_init is not None:
                self._step(pending_init, policy="Never" if policy == "Never" else "OnFailure")
                init_failed = (
                    pending_init.done
                    and pending_init.state.get("terminated", {}).get("exitCode", 0) != 0
                )
                if init_failed:
                    for c in mains:
                        c.done = True
                        c.state = {"waiting": {"reason": "PodInitializing"}}
            else:
                for container in mains:
                    self._step(container, policy=policy)
            if all(c.done for c in mains) and any(not c.done for c in inits):
                self._stop_sidecars(inits)
            self._report()
            if all(c.done for c in self._containers):
                self._teardown_network()
                self._wait_for_deletion()
                return
            self._wake.wait(POLL_SECONDS)
            self._wake.clear()

    def _stop_sidecars(self, inits: list[podstatus.Container]) -> None:
        """The app containers are done: stop the native sidecars, as the kubelet does."""
        self._terminate(grace=min(self._grace(), SIDECAR_STOP_SECONDS))
        for container in inits:
            container.done = True

    def _grace(self) -> float:
        meta = self.pod["metadata"]
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
        return float(grace)

    # ------------------------------------------------------------- setup
    def _setup(self) -> bool:
        """Network namespace and volumes; retried until they work or the pod goes."""
        self.dir.mkdir(parents=True, exist_ok=True)
        spec = self.pod["spec"]
        hostname = hosts.pod_hostname(name=self.name, hostname=spec.get("hostname"))
        self.netns_index = self.ctx.allocate_index()
        ns, self.ip = network.create_pod_netns(index=self.netns_index, hostname=hostname)
        self.ctx.network_attached(self.pod, ns, self.ip)
        network.write_in_place(
            network.ETC_NETNS / ns / "resolv.conf", hosts.resolv_conf(self.namespace)
        )
        self.address = hosts.PodAddress(
            namespace=self.namespace,
            name=self.name,
            hostname=hostname,
            subdomain=spec.get("subdomain"),
            ip=self.ip,
        )
        self.ctx.hosts_changed()
        while not self.ctx.stopping.is_set():
            if self.pod["metadata"].get("deletionTimestamp"):
                return False
            try:
                self._volume_dirs = volumes.materialize(
                    core=self.ctx.core, pod=self.pod, pod_dir=self.dir, pod_ip=self.ip
                )
                return True
            except (podspec.SpecError, ApiException) as exc:
                reason = getattr(exc, "reason", "ContainerCreating")
                self._report_waiting(str(reason), str(exc))
            self._wake.wait(2.0)
            self._wake.clear()
        return False

    def _report_waiting(self, reason: str, message: str) -> None:
        status = podstatus.status_body(
            phase="Pending",
            pod_ip=self.ip,
            start_time=self._start_time,
            containers=[
                {
                    "name": c["name"],
                    "image": c.get("image", ""),
                    "imageID": "",
                    "ready": False,
                    "started": False,
                    "restartCount": 0,
                    "state": {"waiting": {"reason": reason, "message": message[:1000]}},
                }
                for c in self.pod["spec"].get("containers") or []
            ],
            inits=[],
        )
        self._patch_status(status)

    # ------------------------------------------------------------- containers
    def _base_env(self, hostname: str) -> dict[str, str]:
        venv_bin = str(pathlib.Path(sys.executable).parent)
        tmp = self.dir / "tmp"
        tmp.mkdir(exist_ok=True)
        tmp.chmod(0o1777)
        return {
            "PATH": f"{venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8",
            "HOSTNAME": hostname,
            "TMPDIR": str(tmp),
        }

    def _start(self, container: podstatus.Container) -> None:
        if self.ctx.stopping.is_set() or self.address is None or self.netns_index is None:
            return
        secrets, config_maps = volumes.env_sources(
            core=self.ctx.core,
            namespace=self.namespace,
            containers=[c.spec for c in self._containers],
        )
        termination = self.dir / "termination" / f"{container.name}-{container.restart_count}"
        termination.parent.mkdir(parents=True, exist_ok=True)
        termination.write_bytes(b"")
        termination.chmod(0o666)  # writable whatever user the program runs as
        container.termination_file = str(termination)
        try:
            plan = podspec.plan_container(
                pod=self.pod,
                container=container.spec,
                pod_ip=self.ip,
                host_ip="127.0.0.1",
                hostname=self.address.hostname,
                secrets=secrets,
                config_maps=config_maps,
                volume_dirs=self._volume_dirs,
                base_env=self._base_env(self.address.hostname),
                termination_file=str(termination),
            )
        except podspec.SpecError as exc:
            container.state = {"waiting": {"reason": exc.reason, "message": str(exc)}}
            container.next_start = time.monotonic() + 5
            return
        plan_path = self.dir / f"{container.name}.plan.json"
        plan_path.write_text(json.dumps(dataclasses.asdict(plan)))
        log_dir = self.dir / "logs" / container.name
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{container.restart_count}.log"
        container.log_path = str(log_path)
        argv = [
            "ip",
            "netns",
            "exec",
            network.netns_name(self.netns_index),
            "unshare",
            "--uts",
            "--mount",
            "--propagation",
            "private",
            sys.executable,
            "-m",
            "cairn.devcluster.agent.launch",
            str(plan_path),
        ]
        with log_path.open("ab") as out:
            container.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.dir,
            )
        container.state = {"running": {"startedAt": podstatus.now()}}
        log.info(
            "container started",
            extra={
                "pod": f"{self.namespace}/{self.name}",
                "container": container.name,
                "pid": container.process.pid,
            },
        )

    def _step(self, container: podstatus.Container, *, policy: str) -> None:
        if container.done:
            return
        if container.process is None:
            if time.monotonic() >= container.next_start:
                self._start(container)
            return
        code = container.process.poll()
        if code is None:
            return
        _kill_leftovers(container)
        exit_code = podstatus.exit_code(code)
        terminated = {
            "exitCode": exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": container.state.get("running", {}).get("startedAt", podstatus.now()),
            "finishedAt": podstatus.now(),
        }
        if code < 0:
            terminated["signal"] = -code
        message = _termination_message(container, exit_code=exit_code)
        if message:
            terminated["message"] = message
        container.process = None
        restart = policy == "Always" or (policy == "OnFailure" and exit_code != 0)
        if container.init and exit_code == 0:
            restart = False
        if restart:
            container.last_state = {"terminated": terminated}
            delay = min(
                self.ctx.backoff_base_seconds * 2**container.restart_count, MAX_BACKOFF_SECONDS
            )
            container.restart_count += 1
            container.next_start = time.monotonic() + delay
            container.state = {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": f"back-off {delay:.0f}s restarting failed container",
                }
            }
        else:
            container.state = {"terminated": terminated}
            container.done = True

    # ------------------------------------------------------------- status
    def _report(self) -> None:
        status = podstatus.status_body(
            phase=podstatus.phase(self._containers),
            containers=[c.status() for c in self._containers if not c.init],
            inits=[c.status() for c in self._containers if c.init],
            pod_ip=self.ip,
            start_time=self._start_time,
        )
        self._patch_status(status)

    def _patch_status(self, status: Obj) -> None:
        if status == self._last_status:
            return
        sent = podstatus.with_transition_times(
            status=status, previous=self._last_sent, at=podstatus.now()
        )
        try:
            self.ctx.core.patch_namespaced_pod_status(self.name, self.namespace, {"status": sent})
            self._last_status, self._last_sent = status, sent
        except ApiException as exc:
            if exc.status != 404:
                log.warning(
                    "pod status patch failed", extra={"pod": self.name, "status": exc.status}
                )

    # ------------------------------------------------------------- teardown
    def _terminate(self, *, grace: float) -> None:
        live = [c for c in self._containers if c.process is not None]
        for container in live:
            _signal(container, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(
            c.process and c.process.poll() is None for c in live
        ):
            time.sleep(0.1)
        for container in live:
            if container.process and container.process.poll() is None:
                _signal(container, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    container.process.wait(5)
            _kill_leftovers(container)
            if container.process is not None:
                code = container.process.poll()
                exit_code = 137 if code is None else podstatus.exit_code(code)
                terminated = {
                    "exitCode": exit_code,
                    "reason": "Error" if exit_code else "Completed",
                    "finishedAt": podstatus.now(),
                }
                message = _termination_message(container, exit_code=exit_code)
                if message:
                    terminated["message"] = message
                container.state = {"terminated": terminated}
                container.process = None
                container.done = True

    def _finish_deletion(self) -> None:
        """Remove the pod object once its processes are gone, as the kubelet does."""
        with contextlib.suppress(ApiException):
            self.ctx.core.delete_namespaced_pod(
                self.name,
                self.namespace,
                body=client.V1DeleteOptions(
                    grace_period_seconds=0, preconditions=client.V1Preconditions(uid=self.uid)
                ),
            )

    def _wait_for_deletion(self) -> None:
        while not self.pod["metadata"].get("deletionTimestamp"):
            self._wake.wait(5.0)
            self._wake.clear()
            if getattr(self, "_gone", False) or self.ctx.stopping.is_set():
                return
        self._finish_deletion()

    def forget(self) -> None:
        """The pod object is gone from the API: stop everything and end."""
        self._gone = True
        with self._lock:
            meta = self._pod["metadata"]
            meta.setdefault("deletionTimestamp", podstatus.now())
            meta["deletionGracePeriodSeconds"] = 0
        self._wake.set()

    def _teardown_network(self) -> None:
        with self._net_lock:
            index, self.netns_index = self.netns_index, None
        if index is not None:
            self.ctx.network_detached(self.pod, network.netns_name(index))
            network.delete_pod_netns(index=index)
            self.ctx.release_index(index)
            self.address = None
            self.ctx.hosts_changed()


def _tail(path: str, limit: int) -> bytes:
    with contextlib.suppress(OSError), open(path, "rb") as log_file:
        log_file.seek(0, os.SEEK_END)
        log_file.seek(max(log_file.tell() - limit, 0))
        return log_file.read()
    return b""


def _termination_message(container: podstatus.Container, *, exit_code: int) -> str:
    """What the container left at its terminationMessagePath (or its log tail)."""
    written = b""
    if container.termination_file:
        with contextlib.suppress(OSError), open(container.termination_file, "rb") as message:
            written = message.read(podstatus.TERMINATION_MESSAGE_MAX_BYTES)
    return podstatus.termination_message(
        written=written,
        log_tail=_tail(container.log_path, 4 * podstatus.FALLBACK_LOG_BYTES)
        if container.log_path
        else b"",
        policy=str(container.spec.get("terminationMessagePolicy") or "File"),
        exit_code=exit_code,
    )


def _kill_leftovers(container: podstatus.Container) -> None:
    """SIGKILL what is left of the container's process group once its main
    process ended: in a container, every process dies with PID 1 (the pid
    namespace goes). Without this a child that outlives its parent and
    catches SIGTERM (a warm launcher's fork server, multiprocessing's
    resource tracker) stayed behind after the pod was gone, ~600 MB each."""
    if container.process is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(container.process.pid, signal.SIGKILL)


def _signal(container: podstatus.Container, sig: signal.Signals) -> None:
    if container.process is not None and container.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(container.process.pid, sig)
