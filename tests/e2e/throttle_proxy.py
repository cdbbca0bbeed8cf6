"""A TCP proxy between the devcluster's pods and its S3 server that can throttle.

Test helper for `test_brownouts.py` (not a test). An asyncio server in a
daemon thread of the test process, bound to the pod network's gateway so
pods reach it as they reach S3; bytes pass unchanged (SigV4 and checksums
stay valid), only their pace is the proxy's. `throttle(bytes_per_second)`
caps the TOTAL rate of each direction over all connections (one token
bucket per direction, so 16 parallel part uploads still share 64 KiB/s);
`release()` forwards at full speed again. `close()` stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import urllib.parse

CHUNK = 4 * 1024
"""Bytes granted at a time while throttled: many connections share the rate fairly."""
START_TIMEOUT_SECONDS = 10.0


class _Bucket:
    """A token bucket (bytes); `None` rate: unlimited."""

    def __init__(self) -> None:
        self.rate: float | None = None
        self._tokens = 0.0
        self._stamp = time.monotonic()
        self._lock = asyncio.Lock()

    async def take(self, nbytes: int) -> None:
        async with self._lock:  # FIFO: connections take turns
            while self.rate is not None:
                now = time.monotonic()
                self._tokens = min(float(CHUNK), self._tokens + (now - self._stamp) * self.rate)
                self._stamp = now
                if self._tokens >= nbytes:
                    self._tokens -= nbytes
                    return
                await asyncio.sleep((nbytes - self._tokens) / self.rate)


class ThrottleProxy:
    """Listens on `bind` (an ephemeral port) and forwards to `upstream` (http://host:port)."""

    def __init__(self, *, upstream: str, bind: str) -> None:
        parsed = urllib.parse.urlparse(upstream)
        self._upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self._bind = bind
        self._loop = asyncio.new_event_loop()
        self._buckets: tuple[_Bucket, _Bucket] | None = None
        self._server: asyncio.Server | None = None
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="throttle-proxy", daemon=True
        )
        self._thread.start()
        if not started.wait(START_TIMEOUT_SECONDS) or self._server is None:
            raise RuntimeError(f"throttle proxy on {bind} did not start")

    @property
    def endpoint_url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"http://{self._bind}:{port}"

    def throttle(self, bytes_per_second: float) -> None:
        """At most this many bytes per second per direction, all connections together."""
        self._loop.call_soon_threadsafe(self._set_rate, bytes_per_second)

    def release(self) -> None:
        self._loop.call_soon_threadsafe(self._set_rate, None)

    def close(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        with contextlib.suppress(RuntimeError):  # the loop already stopped
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(START_TIMEOUT_SECONDS)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(START_TIMEOUT_SECONDS)

    def __enter__(self) -> ThrottleProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _set_rate(self, rate: float | None) -> None:
        assert self._buckets is not None
        for bucket in self._buckets:
            bucket.rate = rate

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)

        async def serve() -> None:
            self._buckets = (_Bucket(), _Bucket())
            self._server = await asyncio.start_server(self._connect, self._bind, 0)

        try:
            self._loop.run_until_complete(serve())
            started.set()
            self._loop.run_forever()
        finally:  # close the loop here, its thread: an unclosed loop warns at GC in a later test
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._buckets is not None
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*self._upstream), START_TIMEOUT_SECONDS
            )
        except (OSError, TimeoutError):
            writer.close()
            return
        await asyncio.gather(
            self._pump(reader, up_writer, self._buckets[0]),
            self._pump(up_reader, writer, self._buckets[1]),
            return_exceptions=True,
        )

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, bucket: _Bucket
    ) -> None:
        try:
            while data := await src.read(CHUNK):
                await bucket.take(len(data))
                dst.write(data)
                await dst.drain()
        finally:
            with contextlib.suppress(OSError, RuntimeError):
                dst.close()
