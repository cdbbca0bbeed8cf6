"""End a training process without Python's interpreter finalization.

Why: torch's gloo backend runs each collective on a worker thread of its
process group, and that thread drops its reference to the collective's
tensors only after the caller's `wait()` has returned. When the caller has
already let go of an output tensor (DCP's full state dict on ranks other than
0 does), that last drop hands a Python object back and needs the GIL. If the
main thread has meanwhile reached interpreter finalization, Python 3.11 ends
the waiting thread with `pthread_exit`, whose unwinding meets a `noexcept`
C++ frame: `std::terminate`, "terminate called without an active exception",
SIGABRT, exit -6, after the job's last step and export were written
(pytorch/pytorch#190489, open). A launcher counts that a failed worker and
restarts the group. `destroy_process_group()` does not join gloo's threads,
and a model sharded with `fully_shard` keeps its process group alive until
finalization, so the race stays open to the last moment.

`exit_process` flushes what a trainer writes through Python (logging
handlers, stdout, stderr) and leaves with `os._exit`: no finalization, no
race. Call it last, after the `CheckpointManager` is closed (its `with`
block ended) and `destroy_process_group()`; `atexit` callbacks do not run.
In a multiprocessing child (torch's function workers, the warm launcher's
forks) it raises `SystemExit(code)` instead: the parent learns the result
only once the function returns, and such a child leaves through `os._exit`
after that anyway.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import sys
import typing


def exit_process(code: int) -> typing.NoReturn:
    """Flush logging and the standard streams, then `os._exit(code)` (in a
    multiprocessing child: `SystemExit(code)`)."""
    if multiprocessing.parent_process() is not None:
        raise SystemExit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        # A closed or detached stream has nothing left to lose.
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
