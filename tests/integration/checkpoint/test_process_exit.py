"""How a training process ends: the manager's own gloo group is joined at a
clean close, and `process_exit.exit_process` leaves without interpreter
finalization (docs/trainer.md, "End the process with `exit_process`").

Covers: after a 2-rank run (gloo, FSDP2) closes its `CheckpointManager`, the
process has only the training group's gloo worker threads left (the
manager's group was joined, not left for finalization); `exit_process(code)`
exits with `code`, flushes a block-buffered stdout and logging, and runs no
`atexit` callback (finalization, where torch's gloo threads can abort the
process, never starts); in a multiprocessing child (torch's function
workers, the warm launcher's forks) it raises `SystemExit(code)` for the
parent's protocol instead.
"""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import subprocess
import sys
import textwrap
import typing

import ckpt_harness  # type: ignore[import-not-found]
import pytest

from cairn.checkpoint import process_exit


@pytest.mark.torch
def test_closed_manager_leaves_only_the_training_groups_threads(tmp_path: pathlib.Path) -> None:
    job = ckpt_harness.launch(
        {"dir": str(tmp_path / "ckpt"), "interval": 2, "keep_last": 2, "steps": 4},
        world=2,
        tmp=tmp_path,
        name="close",
    )
    job.wait()
    for rank in range(2):
        result = job.result(rank)
        # Counted after init_process_group and fully_shard, before the manager:
        # the training group's workers (torch starts 2 per gloo group).
        assert result["gloo_threads_before"] == 2, result
        assert result["all_steps"] == [2, 4], result
        assert result["gloo_threads_after"] == result["gloo_threads_before"], result


def test_exit_process_flushes_and_skips_finalization(tmp_path: pathlib.Path) -> None:
    out, log = tmp_path / "stdout", tmp_path / "log"
    script = textwrap.dedent(
        f"""
        import atexit, logging, sys
        from cairn.checkpoint import process_exit
        logging.basicConfig(filename={str(log)!r}, level=logging.INFO)
        atexit.register(lambda: print("finalized", flush=True))
        logging.getLogger("trainer").info("last step logged")
        sys.stdout.write("unflushed line\\n")  # a file: block-buffered
        process_exit.exit_process(7)
        """
    )
    with out.open("wb") as stream:
        proc = subprocess.run(
            [sys.executable, "-c", script],
            stdout=stream,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": ckpt_harness.PYTHONPATH},
            timeout=120,
            check=False,
        )
    assert proc.returncode == 7
    assert out.read_text() == "unflushed line\n"  # flushed; the atexit print never ran
    assert "last step logged" in log.read_text()


def _child(results: typing.Any) -> None:
    try:
        process_exit.exit_process(3)
    except SystemExit as exc:
        results.put(exc.code)
        raise


def test_exit_process_in_a_multiprocessing_child_raises_for_the_parent() -> None:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_child, args=(results,))
    child.start()
    child.join(120)
    assert results.get(timeout=5) == 3  # raised: the function's caller saw it
    assert child.exitcode == 3
