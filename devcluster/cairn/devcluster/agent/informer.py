"""A minimal list-and-watch informer over the Kubernetes Python client.

Lists, then watches from the list's resourceVersion, and relists on any
watch error or every `resync_seconds`; every object reaches the handler as
the API's own JSON shape (camelCase dicts), and objects missing from a
relist are delivered as DELETED, so a missed event is repaired at the next
resync.
"""

import logging
import threading
from collections.abc import Callable
from typing import Any

from kubernetes import client, watch

log = logging.getLogger("cairn.devcluster.agent")
Handler = Callable[[str, dict[str, Any]], None]


class Informer:
    def __init__(
        self,
        *,
        name: str,
        api_client: client.ApiClient,
        list_fn: Callable[..., Any],
        handler: Handler,
        stop: threading.Event,
        resync_seconds: float = 30.0,
    ) -> None:
        self.name = name
        self.api_client = api_client
        self.list_fn = list_fn
        self.handler = handler
        self.stop = stop
        self.resync_seconds = resync_seconds
        self.synced = threading.Event()
        self._known: dict[str, dict[str, Any]] = {}
        self.thread = threading.Thread(target=self._run, name=f"informer-{name}", daemon=True)

    def _key(self, obj: dict[str, Any]) -> str:
        meta = obj["metadata"]
        return f"{meta.get('namespace', '')}/{meta['name']}"

    def _relist(self) -> str:
        listing = self.list_fn(_request_timeout=30)
        seen = {}
        for item in listing.items:
            obj = self.api_client.sanitize_for_serialization(item)
            seen[self._key(obj)] = obj
            self.handler("SYNC", obj)
        for key in set(self._known) - set(seen):
            self.handler("DELETED", self._known[key])
        self._known = seen
        self.synced.set()
        return str(listing.metadata.resource_version)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                version = self._relist()
                stream = watch.Watch().stream(
                    self.list_fn,
                    resource_version=version,
                    timeout_seconds=int(self.resync_seconds),
                    _request_timeout=self.resync_seconds + 10,
                )
                for event in stream:
                    if self.stop.is_set():
                        return
                    if event["type"] == "ERROR":
                        break
                    obj = self.api_client.sanitize_for_serialization(event["object"])
                    key = self._key(obj)
                    if event["type"] == "DELETED":
                        self._known.pop(key, None)
                    else:
                        self._known[key] = obj
                    self.handler(event["type"], obj)
            except Exception as exc:  # API restarting or watch expired: relist
                log.debug("informer restarting", extra={"informer": self.name, "error": str(exc)})
                self.stop.wait(1.0)

    def start(self) -> None:
        self.thread.start()
