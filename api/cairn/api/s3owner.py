"""The owner object of a job's S3 prefix: where it lives and what it says. Pure.

A job claims its checkpoint prefix by creating ``<prefix>/.cairn/owner.json``
(its UID, namespace and name) with ``If-None-Match: *``. The operator
(``cairn.operator.core.prefixplan``/``prefixapply``) claims it and refuses
verification, retention and ``onDelete`` under a prefix another job owns;
the writer (``cairn.checkpoint.remote.check_prefix_owner``) refuses to
upload into one, a configuration error. Both read the format from here.
"""

import dataclasses
import json

OWNER_KEY = ".cairn/owner.json"
"""Relative to the job's prefix; outside every ``step-<N>/`` folder."""
OWNER_MAX_BYTES = 4096


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Owner:
    """The content of the owner object."""

    uid: str
    namespace: str
    name: str

    def to_json(self) -> bytes:
        body = {"uid": self.uid, "namespace": self.namespace, "name": self.name}
        return json.dumps(body, sort_keys=True).encode()

    def describe(self) -> str:
        return f"{self.namespace}/{self.name} (uid {self.uid})"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Unreadable:
    """An owner object that exists but is not ours to interpret."""

    why: str


def parse_owner(body: bytes) -> Owner | Unreadable:
    try:
        data = json.loads(body[:OWNER_MAX_BYTES])
        return Owner(uid=str(data["uid"]), namespace=str(data["namespace"]), name=str(data["name"]))
    except (ValueError, KeyError, TypeError) as error:
        return Unreadable(why=f"{type(error).__name__}: {str(error)[:200]}")
