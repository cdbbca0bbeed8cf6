"""End to end: the checkpoint lifecycle's failure and control paths on the devcluster.

The real operator process, real pods (the node agent runs them as local
processes), the reference FSDP2 trainer and the real S3 server, as in
`test_quickstart.py`:

- a rank SIGKILLed while a checkpoint step is being written (its data files
  exist in the step folder, the commit has not happened): the next attempt
  resumes from the last committed step before it, never from the partial
  folder, which stays on the shared volume until start-up cleans it;
- suspend → a final checkpoint at the next step boundary → Suspended with no
  pods → unsuspend → the next attempt resumes from exactly that step;
- the node's checkpoint volume emptied between attempts → resume from S3;
- the writer's status patches on a checkpoint-every-step job respect the
  reporter's throttle (one per 2 s) and still end with the final state.

Each test prints its measured numbers (`pytest -s`) on lines starting with
`E2E-NUMBERS` and records them as junit properties.
"""

import contextlib
import itertools
import json
import os
import pathlib
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from cairn.api import manifest
from tests import demo

pytestmark = [pytest.mark.e2e, pytest.mark.cluster, pytest.mark.timeout(720)]

WRITER_MANAGER = "cairn-writer"
THROTTLE_SECONDS = 2.0
PVC_NAME = "ckpt"


# ----------------------------------------------------------------------------- fixtures


# ----------------------------------------------------------------------------- helpers


def _numbers(record_property: Callable[[str, object], None], **values: object) -> None:
    for key, value in values.items():
        record_property(key, value)
    print(f"E2E-NUMBERS {json.dumps(values, sort_keys=True)}", flush=True)


def _set_arg(args: list[str], flag: str, value: object) -> None:
    if flag in args:
        args[args.index(flag) + 1] = str(value)
    else:
        args += [flag, str(value)]


def _job_body(
    devcluster: Any,
    *,
    name: str,
    bucket: str,
    steps: int,
    interval: int,
    step_delay: float,
    pvc: str | None = None,
    keep_last: int = 2,
    model: dict[str, int] | None = None,
) -> dict[str, Any]:
    body = demo.quickstart_manifest(devcluster.target, name=name)
    spec = body["spec"]
    args: list[str] = list(spec["args"])
    _set_arg(args, "--steps", steps)
    _set_arg(args, "--step-delay", step_delay)
    for flag, value in (model or {}).items():
        _set_arg(args, flag, value)
    spec["args"] = args
    ckpt = spec["checkpoint"]
    ckpt["intervalSteps"] = interval
    ckpt["retention"]["local"]["keepLast"] = keep_last
    ckpt["upload"]["uri"] = f"s3://{bucket}/{name}"
    if pvc is not None:
        ckpt["volume"] = {"persistentVolumeClaim": {"claimName": pvc}}
    return body


def _create_pvc(core: client.CoreV1Api, namespace: str, name: str = PVC_NAME) -> None:
    """A claim of the default (local-path) class, shared by both ranks of a job."""
    core.create_namespaced_persistent_volume_claim(
        namespace,
        client.V1PersistentVolumeClaim(
            metadata=client.V1ObjectMeta(name=name),
            spec=client.V1PersistentVolumeClaimSpec(
                access_modes=["ReadWriteMany"],
                resources=client.V1VolumeResourceRequirements(requests={"storage": "1Gi"}),
            ),
        ),
    )


def _pv_dir(core: client.CoreV1Api, namespace: str, name: str = PVC_NAME) -> pathlib.Path | None:
    """The directory on this machine behind a bound claim (the provisioner's hostPath)."""
    pvc = demo.retrying(lambda: core.read_namespaced_persistent_volume_claim(name, namespace))
    if not pvc.spec.volume_name:
        return None
    pv = demo.retrying(lambda: core.read_persistent_volume(pvc.spec.volume_name))
    return pathlib.Path(pv.spec.host_path.path)


def _follow(
    devcluster: Any,
    namespace: str,
    body: dict[str, Any],
    *,
    on_poll: Callable[[dict[str, Any]], None] | None = None,
    poll_seconds: float = 0.5,
) -> tuple[dict[str, Any], list[demo.Row], float]:
    """Apply the job, follow it to the end, print its rows: (final job, rows, seconds)."""
    rows: list[demo.Row] = []
    started = time.monotonic()
    job = demo.run_job(
        api_client=devcluster.api_client,
        namespace=namespace,
        body=body,
        kill_rank_after_commit=None,
        on_row=rows.append,
        on_poll=on_poll,
        poll_seconds=poll_seconds,
        timeout=600,
    )
    wall = time.monotonic() - started
    for row in rows:
        print("   ", row.line())
    return job, rows, wall


_TMP_FOLDER = re.compile(r"^\.step-(\d+)\.tmp-")
"""An attempt's temporary step folder (`cairn.checkpoint.layout.tmp_dir_name`)."""


def _step_of(folder: pathlib.Path) -> int:
    return int(folder.name.removeprefix("step-"))


def _committed(root: pathlib.Path) -> list[int]:
    return sorted(_step_of(d) for d in root.glob("step-*") if (d / manifest.MANIFEST_NAME).exists())


def _patch_suspend(api_client: client.ApiClient, namespace: str, name: str, value: bool) -> None:
    custom = client.CustomObjectsApi(api_client)
    demo.retrying(
        lambda: custom.patch_namespaced_custom_object(
            demo.GROUP,
            demo.VERSION,
            namespace,
            demo.PLURAL,
            name,
            {"spec": {"suspend": value}},
            _content_type="application/merge-patch+json",
        )
    )


def _job_pods(core: client.CoreV1Api, namespace: str, name: str) -> list[Any]:
    items: list[Any] = demo.retrying(
        lambda: core.list_namespaced_pod(namespace, label_selector=f"cairn.dev/job-name={name}")
    ).items
    return items


def _wait_no_pods(core: client.CoreV1Api, namespace: str, name: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        pods = _job_pods(core, namespace, name)
        if not pods:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pods left while Suspended: {[p.metadata.name for p in pods]}")
        time.sleep(0.5)


def _ckpts(job: dict[str, Any]) -> dict[str, Any]:
    ckpts: dict[str, Any] = (job.get("status") or {}).get("checkpoints") or {}
    return ckpts


def _step(ckpts: dict[str, Any], key: str) -> int | None:
    value = (ckpts.get(key) or {}).get("step")
    return None if value is None else int(value)


class SuspendCycle:
    """An `on_poll` hook: suspend after a commit, check Suspended, maybe act, unsuspend."""

    def __init__(
        self,
        *,
        api_client: client.ApiClient,
        namespace: str,
        name: str,
        after_commit: int,
        while_suspended: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.namespace = namespace
        self.name = name
        self.after_commit = after_commit
        self.while_suspended = while_suspended
        self.suspended_at_step: int | None = None
        self.suspend_requested: float | None = None
        self.suspended_seconds: float | None = None
        self.final: dict[str, Any] | None = None
        self.attempt_suspended: int | None = None
        self.resumed = False
        self.pods_when_suspended: int | None = None

    def __call__(self, job: dict[str, Any]) -> None:
        status = job.get("status") or {}
        phase = status.get("phase")
        ckpts = _ckpts(job)
        if self.suspend_requested is None:
            committed = _step(ckpts, "lastCommitted")
            if phase == "Running" and committed is not None and committed >= self.after_commit:
                self.suspended_at_step = status.get("step")
                self.attempt_suspended = status.get("attempt")
                _patch_suspend(self.api_client, self.namespace, self.name, True)
                self.suspend_requested = time.monotonic()
                demo.say(f"suspend requested at step {self.suspended_at_step}")
            return
        if phase == "Suspended" and not self.resumed:
            self.suspended_seconds = time.monotonic() - self.suspend_requested
            self.pods_when_suspended = len(_job_pods(self.core, self.namespace, self.name))
            _wait_no_pods(self.core, self.namespace, self.name, timeout=30)
            # The writer's last report may trail the phase by one throttle period.
            deadline = time.monotonic() + 10
            while True:
                job = demo.get_job(
                    client.CustomObjectsApi(self.api_client), self.namespace, self.name
                )
                ckpts = _ckpts(job)
                if _step(ckpts, "lastCommitted") == (job.get("status") or {}).get("step"):
                    break
                assert time.monotonic() < deadline, job.get("status")
                time.sleep(0.5)
            self.final = job
            if self.while_suspended is not None:
                self.while_suspended(job)
            _patch_suspend(self.api_client, self.namespace, self.name, False)
            self.resumed = True
            demo.say("unsuspended")


# ----------------------------------------------------------------------------- 1. kill mid-write


class WriteKiller(threading.Thread):
    """SIGKILLs rank 1 the moment its data files of a new step appear on the shared volume.

    A step is written into the attempt's temporary folder
    (`.step-<N>.tmp-<uid8>-a<attempt>/`) and renamed to `step-<N>/` at commit.
    DCP creates `__1_*.distcp` there when rank 1 starts writing its shards;
    rank 1 reports its files to rank 0 only after they are written, CRC'd and
    fsynced, and rank 0 commits (manifest.json) only after every report, so a
    kill at that moment lands inside the write of step N.
    """

    def __init__(
        self, *, core: client.CoreV1Api, namespace: str, name: str, after_commit: int
    ) -> None:
        super().__init__(name="write-killer", daemon=True)
        self.core = core
        self.namespace = namespace
        self.name_ = name
        self.after_commit = after_commit
        self.stop = threading.Event()
        self.root: pathlib.Path | None = None
        self.killed_step: int | None = None
        self.partial: pathlib.Path | None = None
        """Attempt 1's temporary folder of the killed step."""
        self.committed_before: list[int] = []
        self.rank1_files: list[tuple[str, int]] = []
        self.pid: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # surfaced by the test
            self.error = exc

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.root is None:
                with contextlib.suppress(ApiException):
                    self.root = _pv_dir(self.core, self.namespace)
            if self.root is not None and self.pid is None:
                self.pid = demo.rank_pid(
                    self.core, namespace=self.namespace, job=self.name_, rank=1
                )
            if self.root is not None and self.pid is not None:
                committed = _committed(self.root)
                if committed and committed[-1] >= self.after_commit:
                    break
            time.sleep(0.2)
        assert self.root is not None and self.pid is not None
        root = self.root
        while not self.stop.is_set():
            newest = max(_committed(root), default=-1)
            for folder in sorted(root.glob(".step-*.tmp-*")):
                match = _TMP_FOLDER.match(folder.name)
                if match is None or int(match.group(1)) <= newest:
                    continue
                mine = list(folder.glob("__1_*"))
                if mine:
                    os.kill(self.pid, signal.SIGKILL)
                    self.killed_step = int(match.group(1))
                    self.partial = folder
                    self.committed_before = _committed(root)
                    self.rank1_files = [(p.name, p.stat().st_size) for p in mine if p.exists()]
                    demo.say(
                        f"SIGKILLed rank 1 (pid {self.pid}) while writing step {self.killed_step}: "
                        f"{self.rank1_files}"
                    )
                    return
            time.sleep(0.001)


def test_kill_during_checkpoint_write_resumes_from_last_commit(
    devcluster: Any, space: tuple[str, str], record_property: Callable[[str, object], None]
) -> None:
    namespace, bucket = space
    name = "killwrite"
    steps = 40
    core = client.CoreV1Api(devcluster.api_client)
    _create_pvc(core, namespace)
    body = _job_body(
        devcluster,
        name=name,
        bucket=bucket,
        steps=steps,
        interval=5,
        step_delay=0.2,
        pvc=PVC_NAME,
        keep_last=3,
        # Bigger shards than the quickstart's, so the write of a step lasts long
        # enough to be caught on disk.
        model={"--dim": 256, "--layers": 4},
    )
    killer = WriteKiller(core=core, namespace=namespace, name=name, after_commit=10)
    killer.start()
    seen: dict[str, Any] = {}

    def on_poll(job: dict[str, Any]) -> None:
        status = job.get("status") or {}
        # Attempt 1 is over once Restarting (the backoff is 5 s): rank 0 could only
        # have committed the killed step if rank 1 had reported its files.
        if (
            killer.killed_step is not None
            and "manifest_after_kill" not in seen
            and status.get("phase") == "Restarting"
            and killer.root is not None
        ):
            folder = killer.root / f"step-{killer.killed_step:09d}"
            seen["manifest_after_kill"] = (folder / manifest.MANIFEST_NAME).exists()
            seen["partial_exists"] = killer.partial is not None and killer.partial.exists()
            seen["committed_at_restart"] = _step(_ckpts(job), "lastCommitted")

    try:
        job, _rows, wall = _follow(devcluster, namespace, body, on_poll=on_poll)
    finally:
        killer.stop.set()
        killer.join(5)
    if killer.error is not None:
        raise killer.error

    killed = killer.killed_step
    assert killed is not None, "rank 1 was never caught writing a step"
    last_before = max(s for s in killer.committed_before if s < killed)
    status = job["status"]
    ckpts = status["checkpoints"]
    resumed = ckpts["resumedFrom"]
    _numbers(
        record_property,
        test="kill_during_write",
        killed_step=killed,
        rank1_files_at_kill=killer.rank1_files,
        committed_at_kill=killer.committed_before,
        partial_manifest_after_kill=seen.get("manifest_after_kill"),
        resumed_from=resumed,
        final_committed=_step(ckpts, "lastCommitted"),
        final_uploaded=_step(ckpts, "lastUploaded"),
        wall_seconds=round(wall, 1),
    )
    assert status["phase"] == "Succeeded", status
    assert status["attempt"] == 2 and status["restarts"] == 1
    assert seen.get("manifest_after_kill") is False, "the killed step got committed after all"
    assert seen.get("partial_exists") is True, "the partial folder should still be on the volume"
    assert resumed["step"] == last_before, (resumed, killer.committed_before)
    assert resumed["step"] < killed
    assert resumed.get("attempt") == 2
    assert resumed.get("source") == "local"  # shared PVC: the committed steps are still there
    assert _step(ckpts, "lastCommitted") == steps
    assert _step(ckpts, "lastUploaded") == steps
    assert status["step"] == steps
    # Attempt 2's writer went on from attempt 1's records: its steps stay in history.
    assert set(killer.committed_before) <= {r["step"] for r in ckpts["history"]}
    assert not ckpts.get("inFlight")
    # The new attempt wrote the killed step again, from scratch, and committed it itself.
    root = killer.root
    assert root is not None
    redone = root / f"step-{killed:09d}" / manifest.MANIFEST_NAME
    if redone.exists():
        assert manifest.parse_manifest(redone.read_bytes()).attempt == 2


# ----------------------------------------------------------------------------- 2. suspend


def test_suspend_takes_a_final_checkpoint_and_resumes_from_it(
    devcluster: Any, space: tuple[str, str], record_property: Callable[[str, object], None]
) -> None:
    namespace, bucket = space
    name = "suspend"
    steps, interval = 60, 10
    body = _job_body(
        devcluster, name=name, bucket=bucket, steps=steps, interval=interval, step_delay=0.3
    )
    cycle = SuspendCycle(
        api_client=devcluster.api_client, namespace=namespace, name=name, after_commit=interval
    )
    job, rows, wall = _follow(devcluster, namespace, body, on_poll=cycle)

    assert cycle.final is not None, "never reached Suspended"
    held = cycle.final["status"]
    final_step = _step(held["checkpoints"], "lastCommitted")
    status = job["status"]
    ckpts = status["checkpoints"]
    resumed = ckpts["resumedFrom"]
    _numbers(
        record_property,
        test="suspend_resume",
        step_at_suspend_request=cycle.suspended_at_step,
        final_checkpoint_step=final_step,
        final_step_is_interval_multiple=final_step is not None and final_step % interval == 0,
        uploaded_when_suspended=_step(held["checkpoints"], "lastUploaded"),
        seconds_to_suspended=round(cycle.suspended_seconds or -1, 1),
        pods_seen_when_suspended=cycle.pods_when_suspended,
        resumed_from=resumed,
        wall_seconds=round(wall, 1),
    )
    assert held["phase"] == "Suspended"
    assert final_step is not None and cycle.suspended_at_step is not None
    assert final_step >= cycle.suspended_at_step  # a boundary after the request
    assert held["step"] == final_step  # the step training stopped at is the one checkpointed
    assert _step(held["checkpoints"], "lastUploaded") == final_step  # emptyDir: S3 must have it
    assert any(r.phase == "Suspending" for r in rows)

    assert status["phase"] == "Succeeded", status
    assert status["attempt"] == (cycle.attempt_suspended or 0) + 1
    assert resumed["step"] == final_step
    assert resumed.get("attempt") == status["attempt"]
    assert resumed.get("source") == "remote"  # new pods, fresh emptyDir volumes
    assert _step(ckpts, "lastCommitted") == steps
    assert _step(ckpts, "lastUploaded") == steps


# ----------------------------------------------------------------------------- 3. volume lost


def test_emptied_checkpoint_volume_resumes_from_s3(
    devcluster: Any, space: tuple[str, str], record_property: Callable[[str, object], None]
) -> None:
    namespace, bucket = space
    name = "volumelost"
    steps, interval = 40, 5
    core = client.CoreV1Api(devcluster.api_client)
    _create_pvc(core, namespace)
    body = _job_body(
        devcluster,
        name=name,
        bucket=bucket,
        steps=steps,
        interval=interval,
        step_delay=0.25,
        pvc=PVC_NAME,
    )
    deleted: list[str] = []

    def wipe(job: dict[str, Any]) -> None:
        root = _pv_dir(core, namespace)
        assert root is not None
        for folder in sorted(root.glob("step-*")):
            shutil.rmtree(folder)
            deleted.append(folder.name)
        assert not list(root.glob("step-*"))
        demo.say(f"deleted {deleted} from the node's checkpoint volume {root}")

    cycle = SuspendCycle(
        api_client=devcluster.api_client,
        namespace=namespace,
        name=name,
        after_commit=2 * interval,
        while_suspended=wipe,
    )
    job, _rows, wall = _follow(devcluster, namespace, body, on_poll=cycle)

    assert cycle.final is not None, "never reached Suspended"
    held = cycle.final["status"]["checkpoints"]
    final_step = _step(held, "lastCommitted")
    status = job["status"]
    ckpts = status["checkpoints"]
    resumed = ckpts["resumedFrom"]
    _numbers(
        record_property,
        test="volume_lost",
        suspended_checkpoint_step=final_step,
        deleted_local_folders=deleted,
        resumed_from=resumed,
        wall_seconds=round(wall, 1),
    )
    assert final_step is not None and f"step-{final_step:09d}" in deleted
    assert _step(held, "lastUploaded") == final_step
    assert status["phase"] == "Succeeded", status
    assert resumed.get("source") == "remote"
    assert resumed["step"] == final_step
    assert resumed.get("attempt") == status["attempt"] == (cycle.attempt_suspended or 0) + 1
    assert _step(ckpts, "lastCommitted") == steps
    assert _step(ckpts, "lastUploaded") == steps


# ----------------------------------------------------------------------------- 4. throttle


def _writer_view(job: dict[str, Any]) -> str:
    status = job.get("status") or {}
    return json.dumps([status.get("step"), status.get("checkpoints")], sort_keys=True)


def _writer_time(job: dict[str, Any]) -> str | None:
    for entry in job["metadata"].get("managedFields") or []:
        if entry.get("manager") == WRITER_MANAGER and entry.get("subresource") == "status":
            time_: str | None = entry.get("time")
            return time_
    return None


def _status_patches_total(api_client: client.ApiClient) -> tuple[float, float]:
    """apiserver_request_total for PATCH trainingjobs/status (all codes, whole server),
    and the server's process start time (a restarted server starts counting again)."""
    samples = demo.apiserver_request_totals(api_client)
    total = sum(
        value
        for labels, value in samples.items()
        if 'resource="trainingjobs"' in labels
        and 'subresource="status"' in labels
        and 'verb="PATCH"' in labels
    )
    return total, samples.get("process_start_time_seconds", 0.0)


class WriterWatch(threading.Thread):
    """Every change of the writer's fields (`status.step`, `status.checkpoints`) as a watch sees it.

    Only the writer writes those fields, and every write that changes an
    object is one event on a watch, so each event that changes them is one
    writer patch that reached the API server.
    """

    def __init__(self, *, api_client: client.ApiClient, namespace: str, name: str) -> None:
        super().__init__(name="writer-watch", daemon=True)
        self.custom = client.CustomObjectsApi(api_client)
        self.namespace = namespace
        self.name_ = name
        self.watch = watch.Watch()
        self.patches: list[tuple[float, str | None, dict[str, Any]]] = []
        self.other_events = 0
        self.reconnects = 0
        self.ready = threading.Event()
        self.stopped = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        last: str | None = None
        resource_version: str | None = None
        try:
            while not self.stopped.is_set():
                try:
                    stream = self.watch.stream(
                        self.custom.list_namespaced_custom_object,
                        demo.GROUP,
                        demo.VERSION,
                        self.namespace,
                        demo.PLURAL,
                        field_selector=f"metadata.name={self.name_}",
                        resource_version=resource_version,
                        timeout_seconds=120,
                    )
                    self.ready.set()
                    for event in stream:
                        obj = event["object"]
                        if event["type"] == "ERROR":
                            resource_version = None  # expired: a fresh list will do
                            break
                        resource_version = obj["metadata"]["resourceVersion"]
                        view = _writer_view(obj)
                        if event["type"] == "MODIFIED" and last is not None and view != last:
                            self.patches.append(
                                (time.monotonic(), _writer_time(obj), obj["status"])
                            )
                        else:
                            self.other_events += 1
                        last = view
                except Exception as exc:  # the API server restarting: watch again from here
                    if not demo._transient(exc):
                        raise
                    self.reconnects += 1
                    time.sleep(1.0)
        except BaseException as exc:
            self.error = exc
        finally:
            self.ready.set()


def test_writer_status_patches_respect_the_throttle(
    devcluster: Any, space: tuple[str, str], record_property: Callable[[str, object], None]
) -> None:
    namespace, bucket = space
    name = "throttle"
    steps = 30
    body = _job_body(devcluster, name=name, bucket=bucket, steps=steps, interval=1, step_delay=0.2)
    watcher = WriterWatch(api_client=devcluster.api_client, namespace=namespace, name=name)
    watcher.start()
    assert watcher.ready.wait(10)
    time.sleep(0.5)  # the watch request is on its way before the job exists
    before, server_started = _status_patches_total(devcluster.api_client)
    job, _rows, wall = _follow(devcluster, namespace, body, poll_seconds=1.0)
    time.sleep(3)  # a last report still travelling
    after, server_started_after = _status_patches_total(devcluster.api_client)
    metrics_delta = after - before if server_started_after == server_started else None
    watcher.stopped.set()
    watcher.watch.stop()
    watcher.join(15)
    if watcher.error is not None:
        raise watcher.error

    status = job["status"]
    ckpts = status["checkpoints"]
    patches = watcher.patches
    times = [t for t, _, _ in patches]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    span = times[-1] - times[0] if times else 0.0
    server_seconds = [s for _, s, _ in patches if s]
    history = ckpts.get("history") or []
    _numbers(
        record_property,
        test="status_throttle",
        steps=steps,
        checkpoints_committed=len([h for h in history if h.get("step")]),
        writer_patches=len(patches),
        patch_span_seconds=round(span, 1),
        max_allowed=int(span // THROTTLE_SECONDS) + 2,
        min_gap_seconds=round(min(gaps), 2) if gaps else None,
        median_gap_seconds=round(sorted(gaps)[len(gaps) // 2], 2) if gaps else None,
        distinct_server_seconds=len(set(server_seconds)),
        apiserver_status_patches_delta=metrics_delta,
        watch_reconnects=watcher.reconnects,
        job_wall_seconds=round(wall, 1),
    )
    assert status["phase"] == "Succeeded", status
    # The final state is reported: the last writer patch carries the last step and commit.
    assert patches, "no writer patch seen"
    last_reported = patches[-1][2]
    assert last_reported["step"] == steps
    assert _step(last_reported["checkpoints"], "lastCommitted") == steps
    assert _step(last_reported["checkpoints"], "lastUploaded") == steps
    assert status["step"] == steps
    assert _step(ckpts, "lastCommitted") == _step(ckpts, "lastUploaded") == steps
    # Throttled: one patch per 2 s (the first is free; the final flush is allowed on top).
    assert len(patches) <= int(span // THROTTLE_SECONDS) + 2, (len(patches), span)
    # Two writer patches are ≥ 2 s apart on the server, so never in the same second there.
    assert len(set(server_seconds)) == len(server_seconds), server_seconds
    # Far fewer patches than checkpoint events (every step: staged, written, committed, …).
    assert len(patches) < steps
    # The API server counted at least these (it also counts the operator's and other jobs'),
    # unless it was restarted meanwhile (its counters start again).
    if metrics_delta is not None:
        assert metrics_delta >= len(patches)
