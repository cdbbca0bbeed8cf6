"""Exceptions of the checkpoint writer; every failure surfaces as one of these."""

from __future__ import annotations

import typing


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, committed, uploaded or restored."""


class FencedError(CheckpointError):
    """A writer of an older attempt tried to commit over a newer attempt."""


class RemoteError(CheckpointError):
    """The object store failed (after bounded retries) or refused a request."""


class TransportError(RemoteError):
    """The object store stayed unreachable or kept failing transiently (5xx,
    throttling, resets, timeouts) after bounded retries. Says nothing about
    the data: a restore that meets it fails instead of falling back."""


class CoordinationTimeoutError(CheckpointError):
    """Another rank did not report within the bound (dead or stalled)."""


class PeerLostError(CoordinationTimeoutError):
    """A rank that had not reported stopped its heartbeat: presumed dead, the
    wait ends before its bound (`cairn.checkpoint.liveness`)."""


class ConfigurationError(CheckpointError):
    """The job as written cannot resume: a deterministic start-up problem that a
    restart cannot fix (resume target missing, unloadable or of a newer
    format). The reference trainer exits with `exitcodes.CONFIG_ERROR`."""


def to_doc(exc: BaseException) -> dict[str, typing.Any]:
    """An exception as a coordinator document (another rank re-raises it: `raise_doc`)."""
    return {"error": str(exc) or repr(exc), "type": type(exc).__name__}


def raise_doc(doc: typing.Mapping[str, typing.Any], *, where: str) -> None:
    """Raise on this rank what another rank raised (same type for the known ones)."""
    if not doc.get("error"):
        return
    kinds: dict[str, type[CheckpointError]] = {
        "ConfigurationError": ConfigurationError,
        "TransportError": TransportError,
        "RemoteError": RemoteError,
    }
    raise kinds.get(doc.get("type", ""), CheckpointError)(f"{where}: {doc['error']}")
