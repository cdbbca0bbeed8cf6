"""The checkpoint timeline picture in docs/observability.md, from a real run.

``record``: runs examples/quickstart.yaml on the devcluster (the operator
must be running: ``scripts/demo`` once, or the test fixtures), SIGKILLs rank
1 after step 10 is committed, polls the job's status every 0.25 s until it
Succeeds, and writes the snapshots to ``checkpoint-timeline.json``.
``render``: draws ``checkpoint-timeline.svg`` from that JSON (pure; no
cluster): one bar per committed step (its write time, the part that stalled
training darker), one per upload (commit to upload), the attempts and the
restart between them, and the step the job resumed from.

    python docs/images/checkpoint_timeline.py record
    python docs/images/checkpoint_timeline.py render
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import time
import uuid
from collections.abc import Callable
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
DATA = HERE / "checkpoint-timeline.json"
PICTURE = HERE / "checkpoint-timeline.svg"
NAMESPACE = "cairn-timeline"
WIDTH, LEFT, RIGHT = 880, 130, 20
ROWS = {"attempt": 40, "write": 80, "upload": 120}
GAP, PAD = 70, 1.0
"""Pixels drawn for a restart; seconds shown around each attempt."""
COLOURS = {"write": "#7aa6d8", "stall": "#1f4e8c", "upload": "#67b36b", "restart": "#f2c14e"}


def record() -> None:
    import sys

    from kubernetes import config

    from cairn.devcluster import cluster

    sys.path.insert(0, str(HERE.parents[1]))  # the repository root: tests/demo.py
    from tests import demo

    target = cluster.Cluster.default()
    api_client = config.new_client_from_config(config_file=str(target.state.admin_kubeconfig))
    demo.prepare_namespace(
        api_client=api_client, target=target, namespace=NAMESPACE, bucket="cairn-demo"
    )
    body = demo.quickstart_manifest(target, name="timeline")
    body["spec"]["checkpoint"]["upload"]["uri"] = f"s3://cairn-demo/timeline-{uuid.uuid4().hex[:8]}"
    snapshots: list[dict[str, Any]] = []

    def keep(job: dict[str, Any]) -> None:
        status = slim(job.get("status") or {})
        if not snapshots or snapshots[-1]["status"] != status:
            snapshots.append({"at": round(time.time(), 3), "status": status})

    final = demo.run_job(
        api_client=api_client,
        namespace=NAMESPACE,
        body=body,
        kill_rank_after_commit=10,
        on_row=lambda row: print(row.line()),
        on_poll=keep,
        poll_seconds=0.25,
    )
    keep(final)
    created = final["metadata"]["creationTimestamp"]
    DATA.write_text(json.dumps({"created": created, "snapshots": snapshots}, indent=1) + "\n")


def slim(status: dict[str, Any]) -> dict[str, Any]:
    """What the picture needs of a status (the JSON stays small enough to commit). Pure."""
    ckpts = status.get("checkpoints") or {}
    kept = {k: ckpts[k] for k in ("lastCommitted", "lastUploaded", "resumedFrom") if k in ckpts}
    kept["history"] = [
        {k: r.get(k) for k in ("step", "state", "time")} for r in ckpts.get("history") or []
    ]
    return {"phase": status.get("phase"), "attempt": status.get("attempt"), "checkpoints": kept}


def _seconds(stamp: str, origin: datetime.datetime) -> float:
    return (datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")) - origin).total_seconds()


def timeline(data: dict[str, Any]) -> dict[str, Any]:
    """Commits, uploads, attempts and resumes (seconds since creation) from the snapshots. Pure."""
    origin = datetime.datetime.fromisoformat(data["created"].replace("Z", "+00:00"))
    commits: dict[tuple[int, str], dict[str, Any]] = {}
    uploads: dict[int, set[float]] = {}
    attempts: dict[int, list[float]] = {}
    resumes: dict[int, int] = {}
    for snap in data["snapshots"]:
        status, at = snap["status"], snap["at"] - origin.timestamp()
        ckpts = status.get("checkpoints") or {}
        if (c := ckpts.get("lastCommitted")) and c.get("time"):
            commits[(c["step"], c["time"])] = c
        if (u := ckpts.get("lastUploaded")) and u.get("time"):
            uploads.setdefault(u["step"], set()).add(_seconds(u["time"], origin))
        for record in ckpts.get("history") or []:
            if record.get("state") == "uploaded" and record.get("time"):
                uploads.setdefault(record["step"], set()).add(_seconds(record["time"], origin))
        if status.get("phase") == "Running" and status.get("attempt"):
            span = attempts.setdefault(status["attempt"], [at, at])
            span[1] = at
        if (r := ckpts.get("resumedFrom")) and r.get("attempt"):
            resumes[r["attempt"]] = r["step"]
    committed: list[dict[str, Any]] = [
        {
            "step": step,
            "at": _seconds(stamp, origin),
            "write": c.get("writeSeconds") or 0.0,
            "stall": c.get("stallSeconds") or 0.0,
        }
        for (step, stamp), c in sorted(commits.items(), key=lambda kv: kv[0][1])
    ]
    for index, c in enumerate(committed):
        # Its upload: the first after it, before the same step was committed again
        # (a step lost with its pod and written anew by the next attempt).
        again = [o["at"] for o in committed[index + 1 :] if o["step"] == c["step"]]
        until = again[0] if again else float("inf")
        done = [t for t in uploads.get(c["step"], ()) if c["at"] <= t < until]
        c["uploaded"] = min(done) if done else None
    return {"commits": committed, "attempts": attempts, "resumes": resumes}


def _bar(x0: float, x1: float, y: int, colour: str, title: str) -> str:
    width = max(x1 - x0, 2.0)
    return (
        f'<rect x="{x0:.1f}" y="{y}" width="{width:.1f}" height="18" fill="{colour}">'
        f"<title>{title}</title></rect>"
    )


def axis(windows: list[tuple[float, float]]) -> Callable[[float], float]:
    """Seconds since creation -> x: the attempts' windows side by side, each gap
    between them (a restart: backoff, new pods) drawn GAP pixels wide. Pure."""
    plotted = sum(end - start for start, end in windows) or 1.0
    scale = (WIDTH - LEFT - RIGHT - GAP * (len(windows) - 1)) / plotted

    def x(seconds: float) -> float:
        offset = float(LEFT)
        for start, end in windows:
            if seconds <= end:
                return offset + max(seconds - start, 0.0) * scale
            offset += (end - start) * scale + GAP
        return offset - GAP

    return x


def svg(line: dict[str, Any]) -> str:
    """The picture. Pure."""
    commits = line["commits"]
    windows = [
        (start - PAD, end + PAD) for _, (start, end) in sorted(line["attempts"].items())
    ] or [(0.0, 1.0)]
    x = axis(windows)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="206" '
        'font-family="sans-serif" font-size="12">',
        '<rect width="100%" height="100%" fill="white"/>',
    ]
    for label, y in (("attempt", 40), ("stall, write", 80), ("commit → S3", 120)):
        parts.append(f'<text x="10" y="{y + 13}">{label}</text>')
    previous_end = None
    for attempt, (start, end) in sorted(line["attempts"].items()):
        if previous_end is not None:
            gap = f"restart: {start - previous_end:.0f} s"
            parts.append(_bar(x(previous_end), x(start), 40, COLOURS["restart"], gap))
            parts.append(f'<text x="{x(previous_end) + 4:.1f}" y="100" font-size="10">{gap}</text>')
        parts.append(_bar(x(start), x(end), 40, "#d9d9d9", f"attempt {attempt} Running"))
        text = f"attempt {attempt}"
        if attempt in line["resumes"]:
            text += f": resumed from step {line['resumes'][attempt]}"
        parts.append(f'<text x="{x(start) + 4:.1f}" y="53">{text}</text>')
        previous_end = end
    for c in commits:
        # Training stalls while the save stages; the write then runs in the background.
        start = c["at"] - c["write"]
        title = f"step {c['step']}: stall {c['stall']:.2f} s, then write {c['write']:.2f} s"
        parts.append(_bar(x(start - c["stall"]), x(start), 80, COLOURS["stall"], title))
        parts.append(_bar(x(start), x(c["at"]), 80, COLOURS["write"], title))
        parts.append(f'<text x="{x(c["at"]) - 6:.1f}" y="76" font-size="10">{c["step"]}</text>')
        if (done := c["uploaded"]) is not None:
            lag = f"step {c['step']}: in S3 {done - c['at']:.2f} s after its commit"
            parts.append(_bar(x(c["at"]), x(done), 120, COLOURS["upload"], lag))
    last_tick = -1e9
    for start, end in windows:
        for tick in (start + PAD, end - PAD):
            if x(tick) - last_tick < 30:  # two windows' edges at one place: one label
                continue
            last_tick = x(tick)
            parts.append(f'<text x="{x(tick) - 8:.1f}" y="165" font-size="10">{tick:.0f} s</text>')
    parts.append(
        '<text x="10" y="184" font-size="11" fill="#555">examples/quickstart.yaml '
        "on the devcluster, rank 1 SIGKILLed after step 10 (an attempt that failed at "
        "start shows as restart time only).</text>"
    )
    parts.append(
        '<text x="10" y="198" font-size="11" fill="#555">Seconds since the job was '
        "created; drawn by docs/images/checkpoint_timeline.py from the job's status.</text>"
    )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["record", "render"])
    if parser.parse_args().action == "record":
        record()
    PICTURE.write_text(svg(timeline(json.loads(DATA.read_text()))))


if __name__ == "__main__":
    main()
