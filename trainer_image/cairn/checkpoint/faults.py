"""Fault-injection pause points, controlled by environment variables.

Tests kill a rank at a precise phase of the lifecycle: they set
`CAIRN_CKPT_FAULT=<phase>[:<rank>[:<step>]]` and `CAIRN_CKPT_FAULT_DIR`; when
the writer reaches that pause point it writes `<dir>/<phase>-<rank>-<step>`
(containing its pid) and sleeps, bounded, so the test can SIGKILL it there
(or let it go on: the writer resumes once `<dir>/<phase>-<rank>-<step>.release`
exists, which is how a test holds a zombie writer and then releases it).
Unset (production), a pause point is a dictionary lookup.
"""

from __future__ import annotations

import os
import pathlib
import time

ENV_FAULT = "CAIRN_CKPT_FAULT"
ENV_FAULT_DIR = "CAIRN_CKPT_FAULT_DIR"
ENV_FAULT_SLEEP = "CAIRN_CKPT_FAULT_SLEEP"

PHASES = (
    "staging",
    "write",
    "commit",
    "upload",
    "marker",
    "rotate",
    "supersede",
    "restore",
    "quarantine",
)


def pause_point(phase: str, *, rank: int, step: int) -> None:
    """Stop here (bounded) if the environment asks for a fault at this point."""
    spec = os.environ.get(ENV_FAULT)
    if not spec:
        return
    want_phase, _, rest = spec.partition(":")
    want_rank, _, want_step = rest.partition(":")
    if want_phase != phase:
        return
    if want_rank and int(want_rank) != rank:
        return
    if want_step and int(want_step) != step:
        return
    directory = pathlib.Path(os.environ.get(ENV_FAULT_DIR, "."))
    marker = directory / f"{phase}-{rank}-{step}"
    marker.write_text(str(os.getpid()))
    # A test holding a zombie lets it go on by creating `<marker>.release`.
    release = marker.with_name(f"{marker.name}.release")
    deadline = time.monotonic() + float(os.environ.get(ENV_FAULT_SLEEP, "120"))
    while time.monotonic() < deadline and not release.exists():
        time.sleep(0.05)
