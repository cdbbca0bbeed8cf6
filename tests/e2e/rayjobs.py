"""Helpers for the Ray runtime's e2e tests and bench/ray_recovery.py (not tests).

A run is ``examples/quickstart-ray.yaml`` (or the torchrun quickstart with the
same trainer arguments) plus an ``out`` emptyDir at ``/out`` where rank 0
writes its per-step losses (``--losses-file``) and the exported weights
(``--export``): the devcluster keeps each pod's volume as a host directory,
so a test reads them there, and the losses file's growth is the "next
training step" clock of the recovery measurements. Kills are by PID: a rank
actor's PID comes from the driver's ``group N started: … pids [...]`` line in
the head pod's log, a pod's process is the container's PID
(``cairn://<pid>``).
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import time
import uuid
from typing import Any

from kubernetes import client

from tests import demo

OUT = "/out"
OUT_VOLUME = "out"
LOSSES = "losses.jsonl"
EXPORT = "model.safetensors"
POLL_SECONDS = 0.05
REFERENCE = "cairn.trainer.reference"
PLAIN_TORCHRUN = ["torchrun", "-m", REFERENCE]
WARM_TORCHRUN = ["python", "-m", "cairn.trainer.launch", f"--preload={REFERENCE}", "-m", REFERENCE]
MEMORY_TIER = {"enabled": True, "sizeLimit": "256Mi"}
"""`checkpoint.memory` of the e2e jobs and benches that turn the memory tier on
(a few MB a step for the quickstart's model); copy it into a manifest."""
"""The reference trainer under the warm launcher (docs/operator.md, "Warm restarts")."""
_GROUP_RE = re.compile(r"group (\d+) started: \d+ ranks, pids \[([\d, ]+)\]")


def manifest(
    target: Any, *, name: str, runtime: str, bucket: str, steps: int = 40
) -> dict[str, Any]:
    """The quickstart of ``runtime`` writing losses and weights to /out, its own S3 prefix."""
    body = demo.quickstart_manifest(target, name=name, path=demo.EXAMPLES[runtime])
    spec = body["spec"]
    spec["checkpoint"]["upload"]["uri"] = f"s3://{bucket}/{name}-{uuid.uuid4().hex[:6]}"
    args = list(spec["args"])
    args[args.index("--steps") + 1] = str(steps)
    spec["args"] = [*args, "--losses-file", f"{OUT}/{LOSSES}", "--export", f"{OUT}/{EXPORT}"]
    if runtime == "torchrun":
        # Ray runs each 1-CPU rank actor with OMP_NUM_THREADS=1; torch's CPU
        # kernels reduce in another order with more threads, so the baseline
        # uses one thread too (losses differed in the last bit from step 6 on
        # without it).
        spec["env"] = [{"name": "OMP_NUM_THREADS", "value": "1"}]
    spec["template"] = {
        "volumes": [{"name": OUT_VOLUME, "emptyDir": {}}],
        "volumeMounts": [{"name": OUT_VOLUME, "mountPath": OUT}],
    }
    return body


def pods(core: client.CoreV1Api, namespace: str, job: str) -> list[Any]:
    found = demo.retrying(
        lambda: core.list_namespaced_pod(namespace, label_selector=f"cairn.dev/job-name={job}")
    )
    return sorted(found.items, key=lambda p: p.metadata.name)


def pod_uids(core: client.CoreV1Api, namespace: str, job: str) -> dict[str, str]:
    return {p.metadata.name: p.metadata.uid for p in pods(core, namespace, job)}


def out_dir(state_dir: pathlib.Path, namespace: str, pod: str) -> pathlib.Path | None:
    """The host directory of the pod's /out volume (None until it exists)."""
    found = sorted((state_dir / "pods").glob(f"{namespace}_{pod}_*"))
    return found[-1] / "volumes" / OUT_VOLUME if found else None


def memory_copies(
    state_dir: pathlib.Path, namespace: str, pods: list[str]
) -> dict[int, list[int]] | None:
    """Each rank's complete own copies in its pod's memory volume (the memory
    tier's `rank-<r>/own/step-<N>`, a tmpfs the devcluster mounts on the host),
    steps oldest first; None while a pod's volume is not there yet or a rank
    is keeping a step (its temporary `.step-<N>.tmp` folder): a kill then
    could leave the newest committed step on the volume only."""
    from cairn.api import podenv
    from cairn.checkpoint import layout, memtier

    held: dict[int, list[int]] = {}
    for pod in pods:
        found = sorted((state_dir / "pods").glob(f"{namespace}_{pod}_*"))
        if not found:
            return None
        volume = found[-1] / "volumes" / podenv.MEMORY_VOLUME_NAME
        for folder in volume.glob("rank-*"):
            own = memtier.own_root(folder)
            try:
                names = os.listdir(own)
            except OSError:
                return None
            if any(name.startswith(".") for name in names):
                return None
            held[int(folder.name.removeprefix("rank-"))] = sorted(layout.step_dirs(own))
    return held


def head_pod(job: dict[str, Any]) -> str:
    name = job["metadata"]["name"]
    return f"{name}-a{job['status']['attempt']}-n0"


def loss_lines(state_dir: pathlib.Path, namespace: str, pod: str) -> int:
    folder = out_dir(state_dir, namespace, pod)
    if folder is None or not (folder / LOSSES).exists():
        return 0
    return len((folder / LOSSES).read_text().splitlines())


def exported(state_dir: pathlib.Path, namespace: str, pod: str) -> bytes:
    folder = out_dir(state_dir, namespace, pod)
    assert folder is not None, f"no volume dir of {pod}"
    return (folder / EXPORT).read_bytes()


def losses(state_dir: pathlib.Path, namespace: str, pod: str) -> dict[int, float]:
    """Step -> loss of the surviving lineage (a re-run step overwrites)."""
    import json

    folder = out_dir(state_dir, namespace, pod)
    assert folder is not None
    out: dict[int, float] = {}
    for line in (folder / LOSSES).read_text().splitlines():
        entry = json.loads(line)
        out[entry["step"]] = entry["loss"]
    return out


def group_pids(core: client.CoreV1Api, namespace: str, pod: str) -> dict[int, list[int]]:
    """Rank-actor PIDs of every group the driver started (from the head's log)."""
    text = demo.retrying(lambda: core.read_namespaced_pod_log(pod, namespace, container="trainer"))
    return {
        int(m.group(1)): [int(p) for p in m.group(2).split(",")] for m in _GROUP_RE.finditer(text)
    }


def kill(pid: int) -> float:
    """SIGKILL ``pid``; the monotonic time of the kill."""
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


def wait_new_step(
    state_dir: pathlib.Path, namespace: str, pod: str, *, after_lines: int, timeout: float
) -> float:
    """The monotonic time the losses file of ``pod`` first grew past ``after_lines``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if loss_lines(state_dir, namespace, pod) > after_lines:
            return time.monotonic()
        time.sleep(POLL_SECONDS)
    raise AssertionError(f"{pod}: no new training step within {timeout:.0f}s")


def in_place_restarts(job: dict[str, Any], *, runtime: str = "torchrun") -> int:
    """``status.<runtime>.inPlaceRestarts`` of ``job`` (0 before the first). Pure."""
    return ((job.get("status") or {}).get(runtime) or {}).get("inPlaceRestarts") or 0


def wait_new_group(
    custom: client.CustomObjectsApi,
    namespace: str,
    name: str,
    *,
    after: int,
    deadline: float,
    poll_seconds: float,
    runtime: str = "torchrun",
) -> None:
    """Until ``status.<runtime>.inPlaceRestarts`` exceeds ``after``: a new worker
    group (torchrun) or rank-actor group (ray) recorded itself (before its
    restore), so rank 0's next step-log line is the new group's, not one the
    old worker finished after a fault."""
    while in_place_restarts(demo.get_job(custom, namespace, name), runtime=runtime) <= after:
        assert time.monotonic() < deadline, f"{name}: no new {runtime} group in time"
        time.sleep(poll_seconds)


def lines_once_new_group(
    custom: client.CustomObjectsApi,
    state_dir: pathlib.Path,
    namespace: str,
    name: str,
    head: str,
    *,
    after: int,
    deadline: float,
    poll_seconds: float,
    runtime: str = "torchrun",
) -> int:
    """The lines of ``head``'s step log once a new group is in status
    (`wait_new_group`): a line past them is the new group's first step."""
    wait_new_group(
        custom,
        namespace,
        name,
        after=after,
        deadline=deadline,
        poll_seconds=poll_seconds,
        runtime=runtime,
    )
    return loss_lines(state_dir, namespace, head)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in pathlib.Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return b""


def torchrun_worker_pid(agent: int, *, module: str = "cairn.trainer.reference") -> int | None:
    """The trainer worker under a pod's torchrun agent (the container's PID), or None.

    Plain torchrun's worker is a child running ``python -u -m <module>``; the
    warm launcher's (``cairn.trainer.launch``) is a child of its fork server,
    whose command line (shared by its forks) names ``multiprocessing.forkserver``.
    """
    launchers = (b"torchrun", b"cairn.trainer.launch", b"cairn-torchrun")
    pending = [(pid, False) for pid in _children(agent)]
    while pending:
        pid, forked = pending.pop(0)
        cmdline = _cmdline(pid)
        # The server's own command line names the preloaded modules, the target too.
        server = b"multiprocessing.forkserver" in cmdline
        if forked or (
            not server and module.encode() in cmdline and not any(x in cmdline for x in launchers)
        ):
            return pid
        pending += [(child, server) for child in _children(pid)]
    return None
