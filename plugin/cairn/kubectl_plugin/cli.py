"""``kubectl cairn`` commands: argument parsing and printing.

Commands: ``checkpoints JOB``, ``resume JOB --from-step N``, ``logs JOB
[--rank R]``, ``describe JOB``, ``download JOB --step N``. Decisions and formatting live in ``views``
(pure), API calls in ``kube``.
"""

import argparse
import datetime
import json
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from cairn.kubectl_plugin import kube, resume, views

SUSPEND_POLL_SECONDS = 1.0
CONFLICT_RETRIES = 5


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _checkpoints(k: kube.Kube, options: argparse.Namespace, out: TextIO) -> int:
    job = k.get_job(options.job)
    rows = views.checkpoint_rows(views.parse_status(job))
    if options.output == "json":
        json.dump(
            [
                {
                    "step": r.step,
                    "state": r.state,
                    "bytes": r.bytes,
                    "time": r.time.isoformat() if r.time else None,
                    "local": r.local,
                    "remote": r.remote,
                    "verified": r.verified,
                }
                for r in rows
            ],
            out,
            indent=2,
        )
        out.write("\n")
    elif rows:
        out.write(views.checkpoints_table(rows, now=_now()))
    else:
        out.write(f"trainingjob {options.job}: no checkpoints yet\n")
    return 0


def _resume(k: kube.Kube, options: argparse.Namespace, out: TextIO) -> int:
    """Set the target and unsuspend; a running job is suspended first (the
    operator takes a final checkpoint) and unsuspended once it is Suspended."""
    step: int = options.from_step
    keep: bool = options.keep_suspended
    suspended, patched = _patch_resume(k, options)
    if not suspended and not keep:
        _wait_suspended(k, options, generation=patched["metadata"]["generation"])
        k.patch_job(options.job, resume.UNSUSPEND)
    state = "left suspended" if keep else "resuming"
    out.write(
        f"trainingjob.cairn.dev/{options.job} patched: resume from step {step}, {state}"
        f" (field manager {views.FIELD_MANAGER})\n"
    )
    return 0


def _patch_resume(k: kube.Kube, options: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    """Check, then patch at the version checked; a job changed in between
    (409) is read and checked again, a few times. (Was it suspended, the job.)"""
    for tries_left in reversed(range(CONFLICT_RETRIES)):
        job = k.get_job(options.job)
        reason = resume.refusal(name=options.job, job=job, step=options.from_step)
        if reason is not None:
            raise kube.PluginError(reason)
        suspended = bool(job.get("spec", {}).get("suspend"))
        keep: bool = options.keep_suspended
        edit = resume.edit_patch(
            step=options.from_step,
            request=resume.request_id(_now()),
            resource_version=job["metadata"]["resourceVersion"],
            suspend=(None if keep else False) if suspended else True,
        )
        try:
            return suspended, k.patch_job(options.job, edit)
        except kube.ConflictError:
            if not tries_left:
                raise
    raise AssertionError("unreachable")


def _wait_suspended(k: kube.Kube, options: argparse.Namespace, *, generation: int) -> None:
    """Until the operator reports the suspension of ``generation``, or the deadline."""
    deadline = time.monotonic() + options.timeout
    while True:
        job = k.get_job(options.job)
        if resume.suspended_at(job, generation=generation):
            return
        if time.monotonic() >= deadline:
            phase = (job.get("status") or {}).get("phase")
            raise kube.PluginError(
                f"trainingjob {options.job} is suspending with resume step {options.from_step}"
                f" set, but not Suspended within {options.timeout:g}s (phase {phase});"
                " it resumes from that step once unsuspended: kubectl patch trainingjob"
                f' {options.job} --type merge -p \'{{"spec":{{"suspend":false}}}}\''
            )
        time.sleep(SUSPEND_POLL_SECONDS)


def _logs(k: kube.Kube, options: argparse.Namespace, out: TextIO) -> int:
    job = k.get_job(options.job)
    attempt = options.attempt if options.attempt is not None else views.parse_status(job).attempt
    labelled = k.list_pods(views.pod_selector(job=options.job, attempt=attempt, rank=options.rank))
    pods, foreign = views.own_pods(job, labelled)
    for line in foreign:
        sys.stderr.write(f"ignored pod {line}: it carries the job's labels only\n")
    if not pods:
        out.write(f"trainingjob {options.job}: no pods for attempt {attempt}\n")
        return 1
    if options.follow and len(pods) > 1:
        out.write("--follow needs one pod: pass --rank\n")
        return 2
    prefix = len(pods) > 1
    for pod in pods:
        name = pod["metadata"]["name"]
        rank = pod["metadata"].get("labels", {}).get("cairn.dev/rank", "?")
        for line in k.log_lines(name, follow=options.follow, tail=options.tail):
            out.write(f"[rank {rank}] {line}\n" if prefix else f"{line}\n")
            out.flush()
    return 0


def _describe(k: kube.Kube, options: argparse.Namespace, out: TextIO) -> int:
    job = k.get_job(options.job)
    pods = k.list_pods(views.pod_selector(job=options.job, attempt=None, rank=None))
    out.write(views.describe(job, pods=pods, now=_now()))
    return 0


def _download(k: kube.Kube, options: argparse.Namespace, out: TextIO) -> int:
    from cairn.kubectl_plugin import download  # boto3 only when downloading

    job = k.get_job(options.job)
    src = download.source(job, step=options.step, endpoint=options.endpoint)
    target = options.to or pathlib.Path(f"{options.job}-{src.key_prefix.rsplit('/', 1)[-1]}")
    fetched = download.fetch(src=src, target=target)
    out.write(
        f"step {fetched.step} ({len(fetched.files)} files, {views.human_bytes(fetched.total_bytes)},"
        f" world size {fetched.world_size}) verified into {target}\n"
    )
    return 0


Command = Callable[[kube.Kube, argparse.Namespace, TextIO], int]


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="kubectl cairn", description="Inspect and steer Cairn TrainingJobs."
    )
    top.add_argument("-n", "--namespace", help="namespace (default: the context's)")
    top.add_argument(
        "--kubeconfig", help="path to the kubeconfig (default: $KUBECONFIG, ~/.kube/config)"
    )
    top.add_argument("--context", help="kubeconfig context")
    commands = top.add_subparsers(dest="command", required=True)

    ckpt = commands.add_parser(
        "checkpoints", help="checkpoint steps: state, size, age, local/remote, verified"
    )
    ckpt.add_argument("job")
    ckpt.add_argument("-o", "--output", choices=("table", "json"), default="table")
    ckpt.set_defaults(run=_checkpoints)

    again = commands.add_parser(
        "resume",
        help="resume from a committed step: the next attempt loads it, later ones the newest"
        " (merge patch of spec.suspend and spec.checkpoint.resume; see docs/kubectl-plugin.md)",
    )
    again.add_argument("job")
    again.add_argument("--from-step", type=int, required=True, metavar="N")
    again.add_argument(
        "--keep-suspended",
        action="store_true",
        help="set the step but leave (or make) the job suspended",
    )
    again.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="how long a running job may take to suspend (default 600)",
    )
    again.set_defaults(run=_resume)

    logs = commands.add_parser("logs", help="trainer logs of the current attempt's pods")
    logs.add_argument("job")
    logs.add_argument("--rank", type=int, help="only this node rank")
    logs.add_argument("--attempt", type=int, help="another attempt (default: status.attempt)")
    logs.add_argument("-f", "--follow", action="store_true", help="stream (needs one pod)")
    logs.add_argument("--tail", type=int, help="last N lines per pod")
    logs.set_defaults(run=_logs)

    down = commands.add_parser(
        "download", help="fetch a committed step from S3 and verify every file (CRC32C)"
    )
    down.add_argument("job")
    down.add_argument("--step", type=int, required=True, metavar="N")
    down.add_argument("--to", type=pathlib.Path, help="folder (default: ./<job>-step-<N>)")
    down.add_argument(
        "--endpoint",
        help="S3 endpoint as seen from here (default: spec.checkpoint.upload.endpoint)",
    )
    down.set_defaults(run=_download)

    desc = commands.add_parser(
        "describe", help="summary: phase, progress, checkpoints, pods, conditions"
    )
    desc.add_argument("job")
    desc.set_defaults(run=_describe)
    return top


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    options = parser().parse_args(argv)
    stream = out if out is not None else sys.stdout
    run: Command = options.run
    try:
        k = kube.Kube.connect(
            kubeconfig=options.kubeconfig, context=options.context, namespace=options.namespace
        )
    except kube.PluginError as error:
        sys.stderr.write(f"error: {error}\n")
        return 1
    try:
        return run(k, options, stream)
    except kube.PluginError as error:
        sys.stderr.write(f"error: {error}\n")
        return 1
    finally:
        k.close()
