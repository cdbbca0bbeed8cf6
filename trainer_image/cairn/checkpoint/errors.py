"""Exceptions of the checkpoint writer; every failure surfaces as one of these."""


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


class ConfigurationError(CheckpointError):
    """The job as written cannot resume: a deterministic start-up problem that a
    restart cannot fix (resume target missing, unloadable or of a newer
    format). The reference trainer exits with `exitcodes.CONFIG_ERROR`."""
