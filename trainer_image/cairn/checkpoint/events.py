"""Progress and metrics events of the checkpoint lifecycle.

The writer emits one `ProgressEvent` per finished phase of a step (staged,
written, committed, uploaded, rotated, restored...). A status reporter or a
Prometheus exporter subscribes with any callable; callbacks run in the
writer's thread and must be quick. A failing callback is logged, never fatal.
"""

from __future__ import annotations

import dataclasses
import logging
import typing

log = logging.getLogger(__name__)

Phase = typing.Literal[
    "blocked",
    "staged",
    "written",
    "committed",
    "uploaded",
    "upload_failed",
    "rotated",
    "finished",
    "failed",
    "restored",
    "restore_fallback",
    "quarantined",
    "deleted",
    "kept",
    "superseded",
    "memory_kept",
    "memory_failed",
]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProgressEvent:
    """One finished phase of one checkpoint step on one rank."""

    phase: Phase
    step: int
    rank: int
    seconds: float = 0.0
    """Wall time of this phase (for `blocked`: time the training loop waited)."""
    bytes: int = 0
    """Bytes this rank handled in the phase (written, uploaded, deleted...)."""
    message: str = ""


class ProgressCallback(typing.Protocol):
    def __call__(self, event: ProgressEvent, /) -> None: ...


def emit(callbacks: typing.Sequence[ProgressCallback], event: ProgressEvent) -> None:
    """Deliver an event to every callback; a failing callback is logged, not raised."""
    log.debug("checkpoint event %s", event)
    for callback in callbacks:
        try:
            callback(event)
        except Exception:
            log.exception("checkpoint progress callback failed on %s", event)
