"""GPU ordering of the staging copy after the compute that produced the state.

`save()` is called on the training thread right after `optimizer.step()` was
*enqueued* on the compute stream; the kernels may still be running. DCP's
`DefaultStager` copies device tensors to host buffers on its own staging
stream, from its staging thread; nothing orders that stream after the
compute stream, so the copy could read parameters mid-update. The fix is the
standard CUDA pattern: record an event on the current (compute) stream at
`save()` time and make the staging stream wait for it before any copy is
enqueued. The wait is on the GPU: the training thread does not block.

The CUDA surface is a parameter (`torch.cuda` in production) so that the
wiring can be checked on a machine without a GPU.
"""

from __future__ import annotations

import typing

import torch


class EventLike(typing.Protocol):
    def record(self, stream: typing.Any = None) -> None: ...


class StreamLike(typing.Protocol):
    def wait_event(self, event: typing.Any) -> None: ...


class CudaSurface(typing.Protocol):
    """The part of `torch.cuda` used here."""

    def is_available(self) -> bool: ...

    def current_stream(self) -> typing.Any: ...

    def Event(self) -> EventLike: ...  # noqa: N802 - mirrors torch.cuda.Event


def staging_stream(stager: object) -> StreamLike | None:
    """The stager's private staging stream (None without async staging or GPU).

    `DefaultStager` creates it in its constructor (torch >= 2.9) and keeps it
    as `_staging_stream`; there is no public accessor.
    """
    stream = getattr(stager, "_staging_stream", None)
    return typing.cast(StreamLike | None, stream)


def order_after_compute(
    *, stream: StreamLike | None, cuda: CudaSurface | None = None
) -> EventLike | None:
    """Make `stream` wait for everything enqueued so far on the current stream.

    Returns the recorded event (None when there is no GPU or no separate
    staging stream: copies then run on the current stream, already ordered).
    Must be called on the training thread, before the staging copy is queued.
    """
    surface: CudaSurface = cuda if cuda is not None else typing.cast(CudaSurface, torch.cuda)
    if stream is None or not surface.is_available():
        return None
    event = surface.Event()
    event.record(surface.current_stream())
    stream.wait_event(event)
    return event
