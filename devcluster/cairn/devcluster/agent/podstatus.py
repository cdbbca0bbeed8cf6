"""Pure: the status the kubelet would report for a pod and its containers.

The pod worker (`runtime`) keeps one `Container` per init and app container
and feeds them here; `phase` and `status_body` turn them into the
`pods/status` payload (phase, container states, restart counts, podIP,
hostIP, conditions) without touching the API. Timestamps are passed in or
taken from `now()`, so callers and tests control them.
"""

import dataclasses
import datetime
import subprocess
from typing import Any

Obj = dict[str, Any]
HOST_IP = "127.0.0.1"


def now() -> str:
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
    termination_file: str = ""
    """Host file bind-mounted at the container's terminationMessagePath."""
    log_path: str = ""

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


def exit_code(returncode: int) -> int:
    """Pure: a shell-style exit code; death by signal N reads as 128 + N."""
    return returncode if returncode >= 0 else 128 - returncode


TERMINATION_MESSAGE_MAX_BYTES = 4096
"""The kubelet keeps at most this much of a termination message."""
FALLBACK_LOG_BYTES = 2048
FALLBACK_LOG_LINES = 80
"""FallbackToLogsOnError: the kubelet's tail of the log (80 lines, 2 KiB)."""


def termination_message(*, written: bytes, log_tail: bytes, policy: str, exit_code: int) -> str:
    """Pure: ``state.terminated.message`` as the kubelet derives it: the file the
    container wrote at its terminationMessagePath (at most 4096 bytes), else,
    with ``FallbackToLogsOnError`` and a non-zero exit, the tail of its log."""
    if written.strip():
        return written[:TERMINATION_MESSAGE_MAX_BYTES].decode(errors="replace")
    if policy != "FallbackToLogsOnError" or exit_code == 0:
        return ""
    lines = log_tail.splitlines(keepends=True)[-FALLBACK_LOG_LINES:]
    return b"".join(lines)[-FALLBACK_LOG_BYTES:].decode(errors="replace")


def phase(containers: list[Container]) -> str:
    """Pure: Pending until an app container runs, Succeeded/Failed once all are done."""
    mains = [c for c in containers if not c.init]
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


def status_body(
    *, phase: str, containers: list[Obj], inits: list[Obj], pod_ip: str, start_time: str
) -> Obj:
    """Pure: the `status` of a pods/status patch (conditions without transition times)."""
    ready = phase == "Running" and all(c.get("ready") for c in containers)
    initialized = all(
        "terminated" in c.get("state", {}) and c["state"]["terminated"]["exitCode"] == 0
        for c in inits
    )

    def cond(kind: str, ok: bool) -> Obj:
        return {"type": kind, "status": "True" if ok else "False"}

    status: Obj = {
        "phase": phase,
        "hostIP": HOST_IP,
        "hostIPs": [{"ip": HOST_IP}],
        "startTime": start_time,
        "conditions": [
            cond("PodReadyToStartContainers", bool(pod_ip)),
            cond("Initialized", initialized),
            cond("ContainersReady", ready),
            cond("Ready", ready),
            cond("PodScheduled", True),
        ],
        "containerStatuses": containers,
    }
    if inits:
        status["initContainerStatuses"] = inits
    if pod_ip:
        status["podIP"] = pod_ip
        status["podIPs"] = [{"ip": pod_ip}]
    return status


def with_transition_times(*, status: Obj, previous: Obj | None, at: str) -> Obj:
    """Pure: conditions keep their lastTransitionTime while their status holds."""
    before = {c["type"]: c for c in (previous or {}).get("conditions", [])}
    conditions = []
    for condition in status["conditions"]:
        old = before.get(condition["type"])
        same = old is not None and old["status"] == condition["status"]
        stamp = old["lastTransitionTime"] if same and old else at
        conditions.append({**condition, "lastTransitionTime": stamp})
    return {**status, "conditions": conditions}


def is_sidecar(container: Container) -> bool:
    """A native sidecar: an init container with restartPolicy Always (1.29+)."""
    return container.init and container.spec.get("restartPolicy") == "Always"


def started(container: Container) -> bool:
    """Whether the container ever ran (running now, or restarted before)."""
    return container.process is not None or container.restart_count > 0


def blocks_start(container: Container) -> bool:
    """Whether this init container still holds back the ones after it: a
    regular one until it finished, a sidecar until it started."""
    if is_sidecar(container):
        return not container.done and not started(container)
    return not container.done
