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
import datetime
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
from cairn.devcluster.agent import hosts, podspec, volumes

log = logging.getLogger("cairn.devcluster.agent")
Obj = dict[str, Any]
POLL_SECONDS = 0.2
MAX_BACKOFF_SECONDS = 300.0


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass(kw_only=True)
class Container:
    """A container's process and the status the kubelet would report for it."""

    spec: Obj
    init: bool
    process: subprocess.Popen[bytes] | None = None
    restart_count: int = 0
    state: Obj = dataclasses.field(
        default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}}
    )
    last_state: Obj = dataclasses.field(default_factory=dict)
    next_start: float = 0.0
    done: bool = False  # terminated and will not restart

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def status(self) -> Obj:
        running = "running" in self.state
        return {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": "",
            "containerID": f"cairn://{self.process.pid}" if self.process else "",
            "ready": running and not self.init,
            "started": running,
            "restartCount": self.restart_count,
            "state": self.state,
            "lastState": self.last_state,
        }


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
        self._start_time = _now()
        self._last_status: Obj | None = None
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

    def kill_all(self) -> None:
        """Agent shutdown: stop every process of this pod now."""
        for container in getattr(self, "_containers", []):
            _signal(container, signal.SIGKILL)
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
            self.finished = True

    def _lifecycle(self) -> None:
        self._containers: list[Container] = []
        if not self._setup():
            self._finish_deletion()
            return
        spec = self.pod["spec"]
        inits = [Container(spec=c, init=True) for c in spec.get("initContainers") or []]
        mains = [Container(spec=c, init=False) for c in spec.get("containers") or []]
        self._containers = inits + mains
        policy = spec.get("restartPolicy", "Always")
        token_refresh = volumes.token_refresh_seconds(self.pod)
        next_refresh = time.monotonic() + token_refresh
        while True:
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
            pending_init = next((c for c in inits if not c.done), None)
            if pending_init is not None:
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
            self._report()
            if all(c.done for c in self._containers):
                self._teardown_network()
                self._wait_for_deletion()
                return
            self._wake.wait(POLL_SECONDS)
            self._wake.clear()

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
        while True:
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

    def _report_waiting(self, reason: str, message: str) -> None:
        for container in self.pod["spec"].get("containers") or []:
            del container  # every container waits for the same reason
        status = self._status_body(
            phase="Pending",
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
    def _secrets_and_config_maps(self) -> tuple[dict[tuple[str, str], dict[str, str]], ...]:
        import base64

        secrets: dict[tuple[str, str], dict[str, str]] = {}
        config_maps: dict[tuple[str, str], dict[str, str]] = {}
        for container in self._containers:
            refs = [v.get("valueFrom", {}) for v in container.spec.get("env") or []]
            refs += container.spec.get("envFrom") or []
            for ref in refs:
                for key, store in (("secretKeyRef", secrets), ("secretRef", secrets)):
                    if key in ref and (self.namespace, ref[key]["name"]) not in store:
                        with contextlib.suppress(ApiException):
                            data = (
                                self.ctx.core.read_namespaced_secret(
                                    ref[key]["name"], self.namespace
                                ).data
                                or {}
                            )
                            store[(self.namespace, ref[key]["name"])] = {
                                k: base64.b64decode(v).decode(errors="replace")
                                for k, v in data.items()
                            }
                for key in ("configMapKeyRef", "configMapRef"):
                    if key in ref and (self.namespace, ref[key]["name"]) not in config_maps:
                        with contextlib.suppress(ApiException):
                            cm = self.ctx.core.read_namespaced_config_map(
                                ref[key]["name"], self.namespace
                            )
                            config_maps[(self.namespace, ref[key]["name"])] = dict(cm.data or {})
        return secrets, config_maps

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

    def _start(self, container: Container) -> None:
        assert self.address is not None and self.netns_index is not None
        secrets, config_maps = self._secrets_and_config_maps()
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
        container.state = {"running": {"startedAt": _now()}}
        log.info(
            "container started",
            extra={
                "pod": f"{self.namespace}/{self.name}",
                "container": container.name,
                "pid": container.process.pid,
            },
        )

    def _step(self, container: Container, *, policy: str) -> None:
        if container.done:
            return
        if container.process is None:
            if time.monotonic() >= container.next_start:
                self._start(container)
            return
        code = container.process.poll()
        if code is None:
            return
        exit_code = code if code >= 0 else 128 - code
        terminated = {
            "exitCode": exit_code,
            "reason": "Completed" if exit_code == 0 else "Error",
            "startedAt": container.state.get("running", {}).get("startedAt", _now()),
            "finishedAt": _now(),
        }
        if code < 0:
            terminated["signal"] = -code
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
    def _phase(self) -> str:
        mains = [c for c in self._containers if not c.init]
        if mains and all(c.done for c in mains):
            failed = any(
                c.state.get("terminated", {}).get("exitCode", 1) != 0 or "waiting" in c.state
                for c in mains
            )
            return "Failed" if failed else "Succeeded"
        if any(c.process is not None or "running" in c.state for c in mains) or any(
            c.restart_count for c in mains
        ):
            return "Running"
        return "Pending"

    def _status_body(self, *, phase: str, containers: list[Obj], inits: list[Obj]) -> Obj:
        ready = phase == "Running" and all(c.get("ready") for c in containers)
        initialized = all(
            "terminated" in c.get("state", {}) and c["state"]["terminated"]["exitCode"] == 0
            for c in inits
        )

        def cond(kind: str, ok: bool) -> Obj:
            return {"type": kind, "status": "True" if ok else "False"}

        status: Obj = {
            "phase": phase,
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "startTime": self._start_time,
            "conditions": [
                cond("PodReadyToStartContainers", bool(self.ip)),
                cond("Initialized", initialized),
                cond("ContainersReady", ready),
                cond("Ready", ready),
                cond("PodScheduled", True),
            ],
            "containerStatuses": containers,
        }
        if inits:
            status["initContainerStatuses"] = inits
        if self.ip:
            status["podIP"] = self.ip
            status["podIPs"] = [{"ip": self.ip}]
        return status

    def _report(self) -> None:
        status = self._status_body(
            phase=self._phase(),
            containers=[c.status() for c in self._containers if not c.init],
            inits=[c.status() for c in self._containers if c.init],
        )
        self._patch_status(status)

    def _patch_status(self, status: Obj) -> None:
        if status == self._last_status:
            return
        previous = {c["type"]: c for c in (self._last_status or {}).get("conditions", [])}
        for condition in status["conditions"]:
            old = previous.get(condition["type"])
            same = old is not None and old["status"] == condition["status"]
            condition["lastTransitionTime"] = old["lastTransitionTime"] if same and old else _now()
        try:
            self.ctx.core.patch_namespaced_pod_status(self.name, self.namespace, {"status": status})
            self._last_status = status
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
            if container.process is not None:
                code = container.process.poll()
                exit_code = 137 if code is None else (code if code >= 0 else 128 - code)
                container.state = {
                    "terminated": {
                        "exitCode": exit_code,
                        "reason": "Error" if exit_code else "Completed",
                        "finishedAt": _now(),
                    }
                }
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
            if getattr(self, "_gone", False):
                return
        self._finish_deletion()

    def forget(self) -> None:
        """The pod object is gone from the API: stop everything and end."""
        self._gone = True
        with self._lock:
            meta = self._pod["metadata"]
            meta.setdefault("deletionTimestamp", _now())
            meta["deletionGracePeriodSeconds"] = 0
        self._wake.set()

    def _teardown_network(self) -> None:
        if self.netns_index is not None:
            index, self.netns_index = self.netns_index, None
            network.delete_pod_netns(index=index)
            self.ctx.release_index(index)
            self.address = None
            self.ctx.hosts_changed()


def _signal(container: Container, sig: signal.Signals) -> None:
    if container.process is not None and container.process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(container.process.pid, sig)
