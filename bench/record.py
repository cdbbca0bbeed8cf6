"""Shared by the benches: the JSON record every run leaves under `bench/results/`.

A record holds what a reader needs to judge a figure: the versions (torch,
Python, Cairn), the host's cores, the UTC time, the load average at the
start and at the end of the run (this machine is shared), the seed, the
bench's parameters and every figure and ratio it printed. Docs quote these
files, not prose.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import typing

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def environment() -> dict[str, typing.Any]:
    """Versions, cores, time and load average now (call at the start of a run)."""
    import torch  # the benches that record all run torch; imported here only

    from cairn.checkpoint import pipeline

    return {
        "utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "versions": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "cairn": pipeline.CAIRN_VERSION,
        },
        "host": {"cores": os.cpu_count(), "machine": platform.machine()},
        "load_average_start": list(os.getloadavg()),
    }


def write(
    *,
    bench: str,
    tag: str,
    env: dict[str, typing.Any],
    params: dict[str, typing.Any],
    figures: dict[str, typing.Any],
) -> pathlib.Path:
    """Write `bench/results/<bench>-<tag>-<UTC time>.json`; returns its path."""
    doc = {
        "bench": bench,
        **env,
        "load_average_end": list(os.getloadavg()),
        "params": params,
        "figures": figures,
    }
    RESULTS.mkdir(exist_ok=True)
    stamp = env["utc"].replace("-", "").replace(":", "")
    path = RESULTS / f"{bench}-{tag}-{stamp}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")  # rows keep their order
    return path


def table(paths: list[pathlib.Path]) -> str:
    """The figures of `checkpoint` records side by side as a Markdown table. Pure
    but for reading the files; the docs paste its output."""
    docs = [json.loads(p.read_text()) for p in paths]
    groups = (
        "stall",
        "write",
        "upload",
        "mode",
        "sign",
    )  # records before 2026-11-27T03:30 sorted keys
    keys = sorted(
        docs[0]["figures"]["rows"],
        key=lambda k: next((i for i, g in enumerate(groups) if k.startswith(g)), len(groups)),
    )
    sizes = [f"{d['params']['model_params'] / 1e6:.0f}M" for d in docs]
    head = ["metric", *(f"{s} {c}" for s in sizes for c in ("ours", "anchor", "ratio")), "target"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for key in keys:
        rows = [d["figures"]["rows"].get(key) for d in docs]
        first = next(r for r in rows if r is not None)
        cells = [first["label"].strip().replace("*", "(headline)")]
        for row in rows:
            cells += (
                ["", "", ""]
                if row is None
                else [f"{row['ours']:.3g}", f"{row['baseline']:.3g}", f"{row['ratio']:.3g}"]
            )
        cells.append(first["target"].replace("<=", "≤").replace(">=", "≥"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(table([pathlib.Path(p) for p in sys.argv[1:]]))
