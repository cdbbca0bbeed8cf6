"""The trainer's last word: the reason in the termination message, a documented exit code.

A deterministic start-up failure (an unloadable resume target, a manifest
of a newer format asked for explicitly, a requested step that does not
exist, a malformed pod contract) must not be retried: the trainer writes
the reason to the container's termination message file and exits with
`exitcodes.CONFIG_ERROR` (78); the operator fails the job at once with that
reason (`cairn.api.exitcodes`). The kubelet keeps at most 4096 bytes, so the
message is clipped here, on a UTF-8 boundary.

`CAIRN_TERMINATION_MESSAGE_PATH` overrides the path (tests, and runs
outside Kubernetes where `/dev/termination-log` is not writable).
"""

from __future__ import annotations

import logging
import os
import pathlib
import typing

from cairn.api import exitcodes

log = logging.getLogger(__name__)

PATH_ENV = "CAIRN_TERMINATION_MESSAGE_PATH"


def message_path(env: typing.Mapping[str, str] | None = None) -> pathlib.Path:
    """Where the termination message goes (env override, else the Kubernetes default)."""
    source = os.environ if env is None else env
    return pathlib.Path(source.get(PATH_ENV) or exitcodes.TERMINATION_MESSAGE_PATH)


def clip(message: str, limit: int = exitcodes.TERMINATION_MESSAGE_MAX_BYTES) -> bytes:
    """`message` as UTF-8, at most `limit` bytes, never a broken character. Pure."""
    data = message.encode()
    if len(data) <= limit:
        return data
    return data[:limit].decode(errors="ignore").encode()


def write_reason(message: str, *, env: typing.Mapping[str, str] | None = None) -> bool:
    """Write the termination message; False (logged) when the file cannot be written."""
    path = message_path(env)
    try:
        path.write_bytes(clip(message))
    except OSError as exc:
        log.error("could not write the termination message to %s: %s", path, exc)
        return False
    return True


def config_error(exc: BaseException, *, env: typing.Mapping[str, str] | None = None) -> int:
    """Report a configuration error (log + termination message); returns the exit code."""
    reason = f"{exitcodes.CONFIG_ERROR_REASON}: {exc}"
    log.error("%s (exit %d, not retryable)", reason, exitcodes.CONFIG_ERROR)
    write_reason(reason, env=env)
    return exitcodes.CONFIG_ERROR
