"""Cairn's asynchronous checkpoint writer for FSDP2 training (trainer side).

The lifecycle of a step, `save() → stage → write → commit → upload → rotate`,
reads top to bottom in `cairn.checkpoint.pipeline`; `CheckpointManager` in
`cairn.checkpoint.manager` is the surface a training loop uses; resume lives
in `cairn.checkpoint.restore`. See docs/checkpointing.md.
"""

from cairn.checkpoint.errors import CheckpointError, FencedError, RemoteError
from cairn.checkpoint.events import ProgressEvent
from cairn.checkpoint.manager import CheckpointManager
from cairn.checkpoint.options import CheckpointOptions, S3Options
from cairn.checkpoint.process_exit import exit_process
from cairn.checkpoint.restore import RestoreResult
from cairn.checkpoint.state import ModelOptimizerState, RNGState, TrainState

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "CheckpointOptions",
    "FencedError",
    "ModelOptimizerState",
    "ProgressEvent",
    "RNGState",
    "RemoteError",
    "RestoreResult",
    "S3Options",
    "TrainState",
    "exit_process",
]
