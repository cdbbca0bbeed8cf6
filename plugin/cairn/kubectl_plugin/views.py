"""What ``kubectl cairn`` shows and sends: tables, summaries, patches.

Pure: a TrainingJob (as the API returns it) and the clock in, text or a JSON
merge patch out. No Kubernetes client here (``kube`` does the I/O).
"""

import dataclasses
import datetime
from collections.abc import Sequence
from typing import Any

from cairn.api import jobstatus, podidentity

FIELD_MANAGER = "kubectl-cairn"
LOCAL_STATES = frozenset({"committed", "uploaded", "verified"})
REMOTE_STATES = frozenset({"uploaded", "verified"})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointRow:
    """One checkpoint step as ``kubectl cairn checkpoints`` lists it."""

    step: int
    state: str
    bytes: int | None
    time: datetime.datetime | None
    local: str
    remote: str
    verified: bool


def parse_status(job: dict[str, Any]) -> jobstatus.TrainingJobStatus:
    """The job's status, tolerant of missing or newer fields."""
    return jobstatus.TrainingJobStatus.model_validate(job.get("status") or {})


def operator_verified(status: jobstatus.TrainingJobStatus) -> frozenset[int]:
    """Steps the operator read back from S3 and found matching their manifest.

    ``status.storage`` (operator-owned): every step in ``remoteSteps`` that is
    not in ``corruptSteps`` or ``foreignSteps`` (not the job's own: kept, not
    verified) passed verification, and ``verifiedStep`` is the newest of them.
    """
    storage = status.storage
    if storage is None:
        return frozenset()
    corrupt = set(storage.corrupt_steps or ()) | set(storage.foreign_steps or ())
    steps = {s for s in storage.remote_steps or () if s not in corrupt}
    if storage.verified_step is not None:
        steps.add(storage.verified_step)
    return frozenset(steps)


def checkpoint_rows(status: jobstatus.TrainingJobStatus) -> list[CheckpointRow]:
    """Every step the status knows of, newest first.

    Sources: ``history`` (one record per step, its latest state), then
    ``lastCommitted``/``lastUploaded`` (which may be newer than the bounded
    history) and ``inFlight`` (steps still being written). VERIFIED prefers
    the operator's verification (``status.storage``); the writer's
    ``lastUploaded.verified`` and ``verified`` history records still count.
    """
    ckpts = status.checkpoints or jobstatus.CheckpointsStatus()
    uploaded = ckpts.last_uploaded
    checked = operator_verified(status)
    rows: dict[int, CheckpointRow] = {}
    for record in ckpts.history or ():
        remote = record.state in REMOTE_STATES or (
            uploaded is not None and uploaded.step == record.step
        )
        rows[record.step] = CheckpointRow(
            step=record.step,
            state=record.state,
            bytes=record.bytes,
            time=record.time,
            local="yes"
            if record.state in LOCAL_STATES
            else ("corrupt" if record.state == "corrupt" else "no"),
            remote="yes" if remote else "-",
            verified=record.state == "verified"
            or (uploaded is not None and uploaded.step == record.step and uploaded.verified),
        )
    committed = ckpts.last_committed
    if committed is not None and committed.step not in rows:
        rows[committed.step] = CheckpointRow(
            step=committed.step,
            state="committed",
            bytes=committed.bytes,
            time=committed.time,
            local="yes",
            remote="-",
            verified=False,
        )
    if uploaded is not None:
        known = rows.get(uploaded.step)
        if known is None:
            rows[uploaded.step] = CheckpointRow(
                step=uploaded.step,
                state="verified" if uploaded.verified else "uploaded",
                bytes=uploaded.bytes,
                time=uploaded.time,
                local="?",
                remote="yes",
                verified=uploaded.verified,
            )
        elif known.remote != "yes" or (uploaded.verified and not known.verified):
            rows[uploaded.step] = dataclasses.replace(
                known, remote="yes", verified=known.verified or uploaded.verified
            )
    for step in checked:
        known = rows.get(step)
        if known is not None and not (known.verified and known.remote == "yes"):
            rows[step] = dataclasses.replace(known, remote="yes", verified=True)
    for flight in ckpts.in_flight or ():
        if flight.step not in rows:
            rows[flight.step] = CheckpointRow(
                step=flight.step,
                state=flight.stage,
                bytes=None,
                time=flight.since,
                local="writing",
                remote="-",
                verified=False,
            )
    return sorted(rows.values(), key=lambda row: row.step, reverse=True)


def human_bytes(value: int | None) -> str:
    if value is None:
        return "-"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    raise AssertionError("unreachable")


def age(*, now: datetime.datetime, then: datetime.datetime | None) -> str:
    """kubectl-style short age: 45s, 12m, 3h, 2d."""
    if then is None:
        return "-"
    seconds = max(0, int((now - then).total_seconds()))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    if seconds < 172800:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """kubectl-like left-aligned columns separated by three spaces."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = [
        "   ".join(
            str(cell).ljust(width) for cell, width in zip(line, widths, strict=True)
        ).rstrip()
        for line in [headers, *rows]
    ]
    return "\n".join(lines) + "\n"


CHECKPOINT_HEADERS = ("STEP", "STATE", "SIZE", "AGE", "LOCAL", "REMOTE", "VERIFIED")


def checkpoints_table(rows: Sequence[CheckpointRow], *, now: datetime.datetime) -> str:
    return table(
        CHECKPOINT_HEADERS,
        [
            (
                str(row.step),
                row.state,
                human_bytes(row.bytes),
                age(now=now, then=row.time),
                row.local,
                row.remote,
                "yes" if row.verified else "-",
            )
            for row in rows
        ],
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Progress:
    done: int
    total: int
    files_done: int
    files: int


def progress_line(state: Progress, *, width: int = 30) -> str:
    """``[#######-------]  45%  12.3MiB/27.0MiB  3/7 files``."""
    fraction = 1.0 if state.total == 0 else min(1.0, state.done / state.total)
    filled = int(fraction * width)
    return (
        f"[{'#' * filled}{'-' * (width - filled)}] {fraction * 100:3.0f}%"
        f"  {human_bytes(state.done)}/{human_bytes(state.total)}"
        f"  {state.files_done}/{state.files} files"
    )


def foreign_reason(pod: dict[str, Any], *, job: dict[str, Any]) -> str | None:
    """Why a pod labelled with the job's name is not the job's; None: it is.

    Labels prove nothing (anyone who may create a pod can copy them): the
    operator's rule (``cairn.api.podidentity``) decides, so a decoy's logs are
    never shown as a rank's.
    """
    meta = pod.get("metadata", {})
    labels = meta.get("labels") or {}
    job_meta = job.get("metadata", {})
    return podidentity.why_foreign(
        name=str(meta.get("name", "")),
        attempt=podidentity.int_label(labels, podidentity.LABEL_ATTEMPT),
        rank=podidentity.int_label(labels, podidentity.LABEL_RANK),
        controller=podidentity.controller_uid(meta),
        job_name=str(job_meta.get("name", "")),
        job_uid=str(job_meta.get("uid", "")),
    )


def own_pods(
    job: dict[str, Any], pods: Sequence[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[str]]:
    """The job's own pods, and ``name (why)`` of each foreign one (``foreign_reason``)."""
    own: list[dict[str, Any]] = []
    foreign: list[str] = []
    for pod in pods:
        why = foreign_reason(pod, job=job)
        if why is None:
            own.append(pod)
        else:
            foreign.append(f"{pod.get('metadata', {}).get('name')} ({why})")
    return own, foreign


def pod_selector(*, job: str, attempt: int | None, rank: int | None) -> str:
    """Label selector of the job's pods (``cairn.api.podidentity``'s labels)."""
    parts = [f"{podidentity.LABEL_JOB}={job}"]
    if attempt is not None:
        parts.append(f"{podidentity.LABEL_ATTEMPT}={attempt}")
    if rank is not None:
        parts.append(f"{podidentity.LABEL_RANK}={rank}")
    return ",".join(parts)


def _condition_line(condition: jobstatus.Condition, now: datetime.datetime) -> tuple[str, ...]:
    return (
        condition.type,
        condition.status,
        condition.reason,
        age(now=now, then=condition.last_transition_time),
        condition.message,
    )


def _storage_lines(
    status: jobstatus.TrainingJobStatus,
    *,
    ckpts: jobstatus.CheckpointsStatus,
    upload: dict[str, Any],
    now: datetime.datetime,
) -> list[str]:
    """describe's Committed, Uploaded, Verified and S3 error lines."""
    lines: list[str] = []
    committed = ckpts.last_committed
    uploaded = ckpts.last_uploaded
    lines.append(
        "Committed:     "
        + (
            f"step {committed.step}, {human_bytes(committed.bytes)}, {age(now=now, then=committed.time)} ago"
            if committed
            else "none yet"
        )
    )
    if upload:
        lines.append(
            "Uploaded:      "
            + (
                f"step {uploaded.step} to {uploaded.uri or upload.get('uri', '')}"
                + (
                    " (verified)"
                    if uploaded.verified or uploaded.step in operator_verified(status)
                    else ""
                )
                if uploaded
                else f"none yet (to {upload.get('uri', '')})"
            )
        )
    else:
        lines.append("Uploaded:      upload disabled")
    storage = status.storage
    if upload and storage is not None and storage.verified_step is not None:
        lines.append(
            f"Verified:      step {storage.verified_step} in S3"
            + (f" ({storage.verified_by})" if storage.verified_by else "")
        )
    if upload and storage is not None and storage.last_error:
        lines.append(f"S3 error:      {storage.last_error}")
    return lines


def _pods_table(pods: Sequence[dict[str, Any]]) -> str:
    return table(
        ("NAME", "ATTEMPT", "RANK", "PHASE", "NODE"),
        [
            (
                p.get("metadata", {}).get("name", ""),
                p.get("metadata", {}).get("labels", {}).get("cairn.dev/attempt", "?"),
                p.get("metadata", {}).get("labels", {}).get("cairn.dev/rank", "?"),
                p.get("status", {}).get("phase", "?"),
                p.get("spec", {}).get("nodeName", "-"),
            )
            for p in pods
        ],
    )


def describe(job: dict[str, Any], *, pods: Sequence[dict[str, Any]], now: datetime.datetime) -> str:
    """A one-screen summary: phase, progress, checkpoints, failure, pods, conditions."""
    meta = job.get("metadata", {})
    spec = job.get("spec", {})
    status = parse_status(job)
    ckpts = status.checkpoints or jobstatus.CheckpointsStatus()
    upload = (spec.get("checkpoint") or {}).get("upload") or {}
    lines = [
        f"Name:          {meta.get('namespace', '')}/{meta.get('name', '')}",
        f"Phase:         {status.phase or '-'}"
        + ("  (suspended in spec)" if spec.get("suspend") else ""),
        f"Generation:    {meta.get('generation', '-')} (observed {status.observed_generation if status.observed_generation is not None else '-'})",
        f"Nodes:         {spec.get('nodes', 1)} x {spec.get('procsPerNode', 1)} proc(s)",
        f"Attempt:       {status.attempt if status.attempt is not None else '-'}"
        f"   restarts {status.restarts or 0} ({status.restarts_count_towards_max or 0} counted)",
        f"Step:          {status.step if status.step is not None else '-'}",
        f"Started:       {age(now=now, then=status.start_time)} ago",
    ]
    lines += _storage_lines(status, ckpts=ckpts, upload=upload, now=now)
    if ckpts.resumed_from is not None:
        came = ckpts.resumed_from
        lines.append(
            f"Resumed from:  step {came.step} ({came.source or '?'})"
            + (f", fell back from {came.fell_back_from}" if came.fell_back_from is not None else "")
        )
    if ckpts.in_flight:
        lines.append(
            "In flight:     " + ", ".join(f"step {f.step} {f.stage}" for f in ckpts.in_flight)
        )
    if status.last_failure is not None:
        failure = status.last_failure
        lines.append(
            f"Last failure:  attempt {failure.attempt}: {failure.reason}: {failure.message}"
            + ("" if failure.counted else " (not counted)")
        )
    out = "\n".join(lines) + "\n"
    own, foreign = own_pods(job, pods)
    if own:
        out += "\nPods:\n" + _pods_table(own)
    if foreign:
        out += "\nNot the job's (its labels only, ignored):\n" + "".join(
            f"  {line}\n" for line in foreign
        )
    if status.conditions:
        out += "\nConditions:\n" + table(
            ("TYPE", "STATUS", "REASON", "AGE", "MESSAGE"),
            [_condition_line(c, now) for c in status.conditions],
        )
    return out
