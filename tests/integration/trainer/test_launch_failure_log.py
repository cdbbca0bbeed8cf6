"""The warm launcher's agent logs a failed worker without importing torch._dynamo.

Covers, in a child interpreter with the locked torch (torch's log handlers are
process-wide): a failed worker logged as torch's elastic agent logs it
(``logger.exception`` on the process context's logger) makes torch's own log
formatter import ``torch._dynamo`` (the premise: 1.3 s in the agent at the
first restart of every pod); with `launch.log_tracebacks_as_text` applied it
does not, and stderr still shows the message and the whole traceback under
torch's line prefix (level, file and line of the agent's call).
"""

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.torch

CHILD = textwrap.dedent(
    """
    import json, logging, sys, time

    import torch
    from torch.distributed.elastic.multiprocessing import api

    from cairn.trainer import launch

    if sys.argv[1] == "filtered":
        launch.log_tracebacks_as_text()
    try:
        raise RuntimeError("worker 0 terminated with signal SIGKILL")
    except RuntimeError:
        started = time.monotonic()
        api.logger.exception("failed (exitcode: %s) local_rank: %s", -9, 0)
        seconds = time.monotonic() - started
    print(json.dumps({"dynamo": "torch._dynamo" in sys.modules, "seconds": seconds}))
    """
)


def _log_a_failure(mode: str) -> tuple[dict[str, object], str]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_torchs_formatter_imports_dynamo_for_a_traceback() -> None:
    result, stderr = _log_a_failure("plain")
    print(f"    torch's formatter, first traceback: {result['seconds']:.2f}s")
    assert result["dynamo"] is True, result
    assert "RuntimeError: worker 0 terminated with signal SIGKILL" in stderr


def test_the_launchers_filter_logs_the_traceback_as_text_without_dynamo() -> None:
    result, stderr = _log_a_failure("filtered")
    print(f"    with the launcher's filter: {result['seconds']:.2f}s")
    assert result["dynamo"] is False, result
    # torch's prefix (level E, time, pid, the call's file:line) on every line.
    (first,) = [
        line for line in stderr.splitlines() if "failed (exitcode: -9) local_rank: 0" in line
    ]
    prefix = first.split("] ", 1)[0] + "] "
    assert first.startswith("E"), first
    lines = [line.removeprefix(prefix) for line in stderr.splitlines() if line.startswith(prefix)]
    assert "Traceback (most recent call last):" in lines, stderr
    assert lines[-1] == "RuntimeError: worker 0 terminated with signal SIGKILL", stderr
