"""Every TrainingJob's upload prefix, as the operator's own watch has seen it.

``prefixplan.nested_refusal`` needs other jobs' prefixes. They come from the
operator's TrainingJob events (``s3loop.S3Loop.update``/``forget`` feed
``INDEX``), not from the owner objects in S3, which anyone holding the
bucket's keys can write. Read from the S3 threads, written from the event
loop: a lock guards it. Grouped by (store, bucket), so a pass scans only the
jobs that share its bucket.

After an operator restart the index fills as the watch lists the jobs; the
S3 loop's initial delay lets that listing land before the first passes.
"""

from __future__ import annotations

import threading
from typing import Any

from cairn.api import trainingjob
from cairn.operator.core import prefixplan

Key = tuple[str, str]
Store = tuple[tuple[str, str, int] | None, str]


def claim_reason(raw: Any) -> str | None:
    """``status.storage.claim.reason`` of a job body, or None. Pure."""
    try:
        reason = raw["status"]["storage"]["claim"]["reason"]
    except (KeyError, TypeError):
        return None
    return reason if isinstance(reason, str) else None


class PrefixIndex:
    """The prefixes of the jobs the operator knows, by (store, bucket)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_store: dict[Store, dict[Key, prefixplan.PrefixUse]] = {}
        self._store_of: dict[Key, Store] = {}

    def note(self, key: Key, job: trainingjob.TrainingJob, raw: Any) -> None:
        """The job's latest body (a job without ``upload`` leaves the index)."""
        use = prefixplan.PrefixUse.of(job, claim_reason=claim_reason(raw))
        with self._lock:
            self._forget_locked(key)
            if use is None:
                return
            self._by_store.setdefault(use.store, {})[key] = use
            self._store_of[key] = use.store

    def forget(self, key: Key) -> None:
        with self._lock:
            self._forget_locked(key)

    def _forget_locked(self, key: Key) -> None:
        store = self._store_of.pop(key, None)
        if store is None:
            return
        jobs = self._by_store.get(store, {})
        jobs.pop(key, None)
        if not jobs:
            self._by_store.pop(store, None)

    def sharing(self, use: prefixplan.PrefixUse) -> tuple[prefixplan.PrefixUse, ...]:
        """The other jobs on the same store and bucket."""
        with self._lock:
            jobs = self._by_store.get(use.store, {})
            return tuple(other for other in jobs.values() if other.uid != use.uid)

    def __len__(self) -> int:
        with self._lock:
            return len(self._store_of)


INDEX = PrefixIndex()
"""The operator process's one index (like ``s3observe.CLIENTS``)."""
