"""Exceptions of the checkpoint writer; every failure surfaces as one of these."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, committed, uploaded or restored."""


class FencedError(CheckpointError):
    """A writer of an older attempt tried to commit over a newer attempt."""


class RemoteError(CheckpointError):
    """The object store failed (after bounded retries) or refused a request."""


class CoordinationTimeoutError(CheckpointError):
    """Another rank did not report within the bound (dead or stalled)."""
