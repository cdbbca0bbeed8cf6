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
from collections.abc import Callable, Sequence
from typing import TextIO

from cairn.kubectl_plugin import kube, views


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
    job = k.get_job(options.job)
    phase = views.parse_status(job).phase
    if phase in ("Succeeded", "Failed"):
        out.write(
            f"trainingjob {options.job} is {phase}: a finished job does not start again;"
            " create a new job with spec.checkpoint.resume\n"
        )
        return 1
    suspended = bool(job.get("spec", {}).get("suspend"))
    for patch in views.resume_patches(
        step=options.from_step, suspended=suspended, keep_suspended=options.keep_suspended
    ):
        k.patch_job(options.job, patch)
    state = "left suspended" if options.keep_suspended else "resuming"
    out.write(
        f"trainingjob.cairn.dev/{options.job} patched: resume from step {options.from_step}, {state}"
        f" (field manager {views.FIELD_MANAGER})\n"
    )
    return 0


def _logs(k: kube.Kube, options: argparse.Namespace, out: TextIO) -> int:
    job = k.get_job(options.job)
    attempt = options.attempt if options.attempt is not None else views.parse_status(job).attempt
    pods = k.list_pods(views.pod_selector(job=options.job, attempt=attempt, rank=options.rank))
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

    resume = commands.add_parser(
        "resume",
        help="resume from a checkpoint step (merge patch of spec.suspend and spec.checkpoint.resume)",
    )
    resume.add_argument("job")
    resume.add_argument("--from-step", type=int, required=True, metavar="N")
    resume.add_argument(
        "--keep-suspended", action="store_true", help="set the step but leave the job suspended"
    )
    resume.set_defaults(run=_resume)

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
