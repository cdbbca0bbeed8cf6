"""The S3 transport under `remote`: clients, bounds on every request, and
which failures are the network's.

Below the object operations (`cairn.checkpoint.remote`: upload, remote
commit, listing, download). `make_client` builds a client whose botocore
standard retry mode retries 5xx, SlowDown and connection resets a bounded
number of times, with a socket read timeout on each request. A hung store
(a server that accepts connections and moves no bytes) is caught in
seconds: a transfer runs under a progress watchdog (`Watchdog`, polled by
`poll_result`: no byte moved for `stall_seconds` → StallError, and `abort`
cancels the transfer, its worker threads left to end on their own), and a
small request (the manifest, the owner object, a page of a listing) under
the same bound (`bounded`).

The read side keeps transport apart from verification: `is_transient` says
which failures are the network's (pure), `retrying` bounds them in rounds
(`Backoff`), and a missing object or a refusal is reported as such, never
as a verdict on the data.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
import typing

import boto3
import boto3.s3.transfer
import botocore.config
import botocore.exceptions
import botocore.loaders
import botocore.session
import s3transfer.exceptions
import s3transfer.subscribers

from cairn.checkpoint import errors, options

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

log = logging.getLogger(__name__)


def make_client(opts: options.S3Options) -> S3Client:
    """An S3 client with bounded retries and timeouts."""
    config = botocore.config.Config(
        region_name=opts.region,
        connect_timeout=opts.connect_timeout,
        read_timeout=opts.read_timeout,
        retries={"max_attempts": opts.max_attempts, "mode": "standard"},
        max_pool_connections=max(10, opts.concurrency * 2),
        # Checksums only where an operation needs one; we ask for CRC32C
        # explicitly on uploads (and some S3-compatible stores reject the
        # unsigned trailing checksums the default turns on).
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": "path"},
    )
    session = boto3.session.Session(
        aws_access_key_id=opts.access_key,
        aws_secret_access_key=opts.secret_key,
        botocore_session=_botocore_session(),
    )
    _dedupe_search_paths()
    client: S3Client = session.client("s3", endpoint_url=opts.endpoint_url, config=config)
    return client


@functools.cache
def _shared_loader() -> botocore.loaders.Loader:
    """The data loader every botocore session of this process uses (made once,
    as a session makes its own: honouring ``AWS_DATA_PATH``)."""
    loader: botocore.loaders.Loader = botocore.session.Session().get_component("data_loader")
    return loader


def _botocore_session() -> botocore.session.Session:
    """A new botocore session whose data loader is the process's shared one.

    A client's creation reads S3's service model, endpoint rules and
    partitions from gzipped JSON; a session's loader caches them, but every
    new session has a new loader. Sharing one makes every client after the
    first nearly free, and a fork of a process that made one (the warm
    launcher's fork server, `warm_loader`) inherits the cache: measured in
    such a fork, a client in 0.015 s instead of 0.083 s idle (0.15-0.2 s in
    each restarted worker under the devcluster's load)."""
    core = botocore.session.Session()
    core.register_component("data_loader", _shared_loader())
    return core


def _dedupe_search_paths() -> None:
    """boto3 appends its data folder to the loader's search paths at every
    session it makes; with one shared loader they would pile up."""
    paths = _shared_loader().search_paths
    paths[:] = list(dict.fromkeys(paths))


def warm_loader() -> None:
    """Fill the shared loader's cache with what an S3 client and a listing read
    (no network: a client to an unused local endpoint, never called)."""
    opts = options.S3Options(
        uri="s3://warm-up",
        endpoint_url="http://127.0.0.1:9",
        region="us-east-1",
        access_key="-",
        secret_key="-",
    )
    make_client(opts).get_paginator("list_objects_v2")


def transfer_config(opts: options.S3Options) -> boto3.s3.transfer.TransferConfig:
    return boto3.s3.transfer.TransferConfig(
        multipart_threshold=opts.part_size,
        multipart_chunksize=opts.part_size,
        max_concurrency=opts.concurrency,
        use_threads=True,
        # The classic s3transfer client honours botocore retries and event
        # hooks; the CRT client would bypass both.
        preferred_transfer_client="classic",
    )


def abort(manager: typing.Any, futures: list[typing.Any]) -> None:
    # Cancel each transfer; the workers end on their own (a request blocked
    # on a hung socket within read_timeout x max_attempts) in a daemon
    # thread, so a hung store never holds the caller. (TransferManager.
    # shutdown's own cancel argument is broken in s3transfer 0.19: it passes
    # its arguments in the wrong order.)
    for future in futures:
        future.cancel()
    threading.Thread(target=manager.shutdown, name="cairn-s3-abort", daemon=True).start()


class StallError(TimeoutError):
    """No byte moved for `stall_seconds`: the store hangs (transient)."""


class Watchdog(s3transfer.subscribers.BaseSubscriber):
    """Notes when the transfers it subscribes to last moved bytes."""

    def __init__(self) -> None:
        self.last = time.monotonic()

    def on_progress(self, future: typing.Any, bytes_transferred: int, **kwargs: typing.Any) -> None:
        if bytes_transferred > 0:  # a retry rewinds with a negative count
            self.last = time.monotonic()

    def on_done(self, future: typing.Any, **kwargs: typing.Any) -> None:
        self.last = time.monotonic()  # the next file's clock starts now


def stall_message(opts: options.S3Options) -> str:
    """The reason a watchdog gives (status `uploadError`). Pure."""
    return f"no progress for {opts.stall_seconds:.0f} s to {opts.endpoint_url or 'AWS S3'}"


RESULT_POLL_SECONDS = 0.01
"""How often `poll_result` looks at a transfer: the step's upload ends at
most this much after its last part (a small step's upload lasts 1-2 s)."""


def poll_result(
    future: typing.Any, *, deadline: float, watchdog: Watchdog, opts: options.S3Options
) -> None:
    while not future.done():
        now = time.monotonic()
        if now - watchdog.last > opts.stall_seconds:
            raise StallError(stall_message(opts))
        if now > deadline:
            raise TimeoutError
        time.sleep(RESULT_POLL_SECONDS)
    future.result()


T = typing.TypeVar("T")


def bounded(call: typing.Callable[[], T], *, seconds: float, what: str) -> T:
    """`call()` in a daemon thread; StallError when it has not returned in
    `seconds` (a small request to a hung store; the thread ends on its own)."""
    done: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            done.append(call())
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, name="cairn-s3-request", daemon=True)
    thread.start()
    thread.join(seconds)
    if failed:
        raise failed[0]
    if not done:
        raise StallError(f"{what}: no answer for {seconds:.0f} s")
    return done[0]


# -- the read side: restore and import ------------------------------------------
#
# Transport is not verification: a transient failure (5xx, throttling, a
# reset, a timeout) is retried here, first by botocore per request, then in
# bounded rounds around a whole fetch (`retrying`); when the rounds are spent
# it is a `TransportError` and the restore fails. Only bytes that arrived and
# do not match the manifest are evidence against a step.

_TRANSIENT_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeoutException",
        "RequestLimitExceeded",
        "PriorRequestNotComplete",
    }
)
_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    botocore.exceptions.ConnectionError,  # EndpointConnectionError, ConnectTimeoutError
    botocore.exceptions.HTTPClientError,  # ConnectionClosedError, ReadTimeoutError, streaming
    botocore.exceptions.IncompleteReadError,
    s3transfer.exceptions.RetriesExceededError,  # a body read kept failing
    TimeoutError,
    ConnectionError,
)


def is_transient(exc: BaseException) -> bool:
    """Pure: whether `exc` is a transport failure worth retrying.

    5xx and throttling answers, connection errors, resets and timeouts are;
    4xx answers (missing object, access denied) and anything else are not.
    """
    if isinstance(exc, botocore.exceptions.ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return status >= 500 or code in _TRANSIENT_CODES
    if isinstance(exc, _TRANSIENT_TYPES):
        return True
    cause = exc.__cause__
    return cause is not None and cause is not exc and is_transient(cause)


def is_not_found(exc: botocore.exceptions.ClientError) -> bool:
    code = exc.response.get("Error", {}).get("Code", "")
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return code in ("NoSuchKey", "404", "NotFound") or status == 404


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Backoff:
    """Rounds of a whole fetch after botocore's own per-request retries."""

    rounds: int = 3
    first_seconds: float = 1.0
    max_seconds: float = 8.0

    def delay(self, round_: int) -> float:
        """Pure: seconds to wait after failed round `round_` (0-based)."""
        return float(min(self.max_seconds, self.first_seconds * 2**round_))


RESTORE_BACKOFF = Backoff()
"""Bound for restore and import reads: with botocore's standard mode
(`S3Options.max_attempts` per request) a dead endpoint fails the restore
after about 3 x (attempts x timeouts) + 3 s instead of falling back."""


def retrying(
    fetch: typing.Callable[[], T],
    *,
    what: str,
    backoff: Backoff = RESTORE_BACKOFF,
    sleep: typing.Callable[[float], None] = time.sleep,
) -> T:
    """Run `fetch`; retry transient failures in bounded rounds, then raise TransportError.

    Non-transient errors pass through unchanged on the first occurrence.
    """
    for round_ in range(backoff.rounds):
        try:
            return fetch()
        except Exception as exc:
            if not is_transient(exc):
                raise
            if round_ + 1 == backoff.rounds:
                raise errors.TransportError(
                    f"{what}: transport kept failing after {backoff.rounds} rounds: {exc}"
                ) from exc
            log.warning("%s: transient S3 failure, retrying: %s", what, exc)
            sleep(backoff.delay(round_))
    raise AssertionError("unreachable: Backoff.rounds >= 1")
