"""Observe step of the S3 pass: credentials, list, head, read and judge manifests.

Blocking (boto3 and the Kubernetes client): call from a worker thread. Reads
only: the decisions are in ``s3plan`` (pure), the deletions in ``s3apply``,
the pass that ties them together in ``s3pass``. Layout (the writer's,
``cairn.checkpoint.remote``): ``s3://bucket/<prefix>/step-<N, 9 digits>/<files>``
with ``manifest.json`` written last.

Credentials: the Secret named by ``upload.credentialsSecretRef`` in the job's
namespace is read at call time (RBAC: ``get`` on secrets, nothing else) and
its values go only into a boto3 client; they are never logged, put in an
event or stored outside process memory. Without a reference, boto3's default
chain applies (e.g. workload identity). Retries: botocore standard mode with
a bounded number of attempts and socket timeouts, so one call is bounded.

The job's manifest keyring (``manifest_keyring``) is read the same way, from
the Secret the operator created for the job (``<job>-manifest-key``, owned by
the job), so the plan can check manifest signatures; its keys go only into
``cairn.api.manifest.Keyring`` (whose repr hides them).

Costs, per pass of one job: two Secret GETs, one LIST of the prefix. Clients
are cached per (endpoint, region, key pair) (``s3clients.ClientCache``:
building one costs ~135 ms of CPU), so a rotated Secret gets a new client on
the next pass and an unchanged one none. A step is judged (its manifest
read, the files it lists headed) only when its fingerprint (every object's
path, size and ETag, and the job's identity) is new to the job's ``Caches``,
which keep verdicts, never parsed manifests: an unchanged prefix costs the
LIST alone.

Bounds (issue 20; what a tenant's bucket holds is untrusted): a manifest is
never read whole past ``tunables.S3.manifest_max_bytes`` (by its listed
size, else a ``Range``), nor kept past ``manifest_max_entries`` files; a
listing stops past ``list_max_keys``; a ``Deadline`` stops a pass before its
next call. The listing itself (pages, slices over passes kept in the job's
``s3list.ListingSlot``, the re-listing before deletions) is ``s3list``'s.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import typing
from typing import Any, Generic, TypeVar

import pydantic
from kubernetes.client import exceptions as k8s_exceptions

from cairn.api import checkpointspec, podenv
from cairn.api import manifest as manifest_mod
from cairn.operator import kubeapi, s3clients, s3list
from cairn.operator.core import names, s3plan, tunables

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client


StoreError = s3list.StoreError
ERRORS = s3list.ERRORS
failure = s3list.failure
Target = s3list.Target
Listed = s3list.Listed
Deadline = s3list.Deadline
NO_DEADLINE = s3list.NO_DEADLINE
ListCapError = s3list.ListCapError
ListingGoesOnError = s3list.ListingGoesOnError
"""Re-exported from ``s3list``, the store's shared vocabulary (callers name them here)."""


def _secret_value(data: dict[str, str], key: str, name: str) -> str:
    if key not in data:
        raise StoreError(f"Secret {name} has no key {key}")
    return base64.b64decode(data[key]).decode()


_last_good: dict[str, tuple[str, str]] = {}
"""Process memory only: the key pair last read for a job (by uid), so that the
``onDelete`` cleanup still works when the Secret went first (a namespace
deletion removes both at once). Never logged, never stored."""


def forget_credentials(job_uid: str) -> None:
    _last_good.pop(job_uid, None)


def manifest_keyring(
    api: kubeapi.KubeApi, *, job: str, namespace: str, job_uid: str
) -> manifest_mod.Keyring | None:
    """The job's manifest keyring from its Secret; None when there is none (404).

    None means the job predates the Secret (its pods never signed): the plan
    then judges manifests by job UID alone. A Secret that is not owned by
    this job (a same-named leftover of a deleted job, or a planted one), is
    unreadable or malformed raises ``StoreError`` (no key bytes in the
    message), and the pass deletes nothing.
    """
    name = names.manifest_key_secret_name(job)
    try:
        secret = api.core.read_namespaced_secret(name, namespace)
    except k8s_exceptions.ApiException as error:
        if error.status == 404:
            return None
        raise StoreError(
            f"reading Secret {namespace}/{name} failed: {error.status} {error.reason}"
        ) from None
    owners = secret.metadata.owner_references or ()
    if not any(ref.uid == job_uid and ref.controller for ref in owners):
        raise StoreError(f"Secret {namespace}/{name} is not owned by this job; not used")
    data: dict[str, str] = secret.data or {}
    try:
        return manifest_mod.parse_keyring(_secret_value(data, podenv.MANIFEST_KEYRING_FILE, name))
    except ValueError as error:
        raise StoreError(f"Secret {namespace}/{name}: {error}") from None


def credentials(
    api: kubeapi.KubeApi, namespace: str, ref: checkpointspec.SecretRef | None, *, job_uid: str = ""
) -> tuple[str | None, str | None]:
    """The access key pair from the referenced Secret (read now), or (None, None).

    With ``job_uid``, a pair read before is remembered in process memory and
    used when the Secret is gone (404).
    """
    if ref is None:
        return None, None
    try:
        secret = api.core.read_namespaced_secret(ref.name, namespace)
    except k8s_exceptions.ApiException as error:
        if error.status == 404 and job_uid in _last_good:
            return _last_good[job_uid]
        raise StoreError(
            f"reading Secret {namespace}/{ref.name} failed: {error.status} {error.reason}"
        ) from None
    data: dict[str, str] = secret.data or {}
    pair = (
        _secret_value(data, ref.access_key_id_key, ref.name),
        _secret_value(data, ref.secret_access_key_key, ref.name),
    )
    if job_uid:
        _last_good[job_uid] = pair
    return pair


make_client = s3clients.make_client
ClientKey = s3clients.ClientKey
client_key = s3clients.client_key
ClientCache = s3clients.ClientCache
"""Re-exported from ``s3clients`` (callers name them here)."""


CLIENTS = ClientCache()
"""The operator's clients (one process, every job)."""


def client_for(
    api: kubeapi.KubeApi,
    namespace: str,
    upload: checkpointspec.UploadSpec,
    *,
    job_uid: str = "",
    cache: ClientCache | None = None,
) -> S3Client:
    """The job's client: its Secret read now, the client reused while the pair holds
    (``cache``: ``CLIENTS``, looked up at call time)."""
    access, secret = credentials(api, namespace, upload.credentials_secret_ref, job_uid=job_uid)
    return (cache or CLIENTS).get(upload, access_key=access, secret_key=secret)


_V = TypeVar("_V")


class EtagCache(Generic[_V]):
    """Values per (key, ETag): what an unchanged object gave once. Starts over
    when ``limit`` entries are reached (a bound, not an eviction policy)."""

    def __init__(self, limit: int) -> None:
        self._items: dict[tuple[str, str], _V] = {}
        self._limit = limit

    def get(self, key: str, etag: str) -> tuple[bool, _V | None]:
        found = (key, etag) in self._items
        return found, self._items.get((key, etag))

    def put(self, key: str, etag: str, value: _V) -> None:
        if len(self._items) >= self._limit:
            self._items.clear()
        self._items[(key, etag)] = value

    def __len__(self) -> int:
        return len(self._items)


ManifestRead = s3plan.ManifestRead


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Caches:
    """One job's memory of its prefix: full-object CRC32Cs, and step verdicts.

    Verdicts (``s3plan.Checked``: the verdict, and a verified step's listed
    paths) by the step's fingerprint; never a parsed manifest, whose memory
    (up to ~15x its bytes) would grow with what a tenant writes.
    """

    heads: EtagCache[str | None] = dataclasses.field(
        default_factory=lambda: EtagCache(tunables.DEFAULT.s3.head_cache_entries)
    )
    verdicts: EtagCache[s3plan.Checked] = dataclasses.field(
        default_factory=lambda: EtagCache(tunables.DEFAULT.s3.manifest_cache_entries)
    )
    listing: s3list.ListingSlot = dataclasses.field(default_factory=s3list.ListingSlot)
    """The listing in progress between passes (``observe`` with ``sliced``)."""


def head_crc32c(s3: S3Client, bucket: str, key: str) -> tuple[int, str | None]:
    """Size and full-object CRC32C (hex) of one object; None if the store has none."""
    head = s3.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    value = typing.cast(dict[str, Any], head)
    crc = s3plan.crc32c_hex_from_s3(value.get("ChecksumCRC32C"), value.get("ChecksumType"))
    return int(value.get("ContentLength", 0)), crc


def _too_large(size: int, max_bytes: int) -> s3plan.ManifestError:
    return s3plan.ManifestError(
        message=f"manifest is {size} bytes, over the operator's limit of {max_bytes}"
        " (S3.manifest_max_bytes): not read"
    )


def read_manifest(
    s3: S3Client,
    target: Target,
    step: int,
    *,
    listed_size: int | None = None,
    bounds: tunables.S3 = tunables.DEFAULT.s3,
) -> ManifestRead:
    """The step's manifest, parsed, or why not. Never holds more than
    ``manifest_max_bytes`` + 1 bytes of it: larger by its listed size is not
    read at all; one that grew since is read by a bounded range and refused."""
    limit = bounds.manifest_max_bytes
    if listed_size is not None and listed_size > limit:
        return _too_large(listed_size, limit)
    key = target.key(step, manifest_mod.MANIFEST_NAME)
    try:
        answer = s3.get_object(Bucket=target.bucket, Key=key, Range=f"bytes=0-{limit}")
        body = answer["Body"].read(limit + 1)
        answer["Body"].close()
    except ERRORS as error:
        raise failure(f"reading s3://{target.bucket}/{key}", error) from None
    if len(body) > limit:
        return _too_large(len(body), limit)
    try:
        parsed = manifest_mod.parse_manifest(body)
    except (pydantic.ValidationError, ValueError) as error:
        first = str(error).splitlines()[0][:200]
        return s3plan.ManifestError(message=first)
    if len(parsed.files) > bounds.manifest_max_entries:
        return s3plan.ManifestError(
            message=f"manifest lists {len(parsed.files)} files, over the operator's limit of"
            f" {bounds.manifest_max_entries} (S3.manifest_max_entries)"
        )
    return parsed


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Identity:
    """Who the job is, for judging its manifests (``s3plan.verify_step``)."""

    job_uid: str | None
    keyring: manifest_mod.Keyring | None = dataclasses.field(default=None, repr=False)

    def digest(self) -> str:
        """What a verdict depends on besides the objects, as a digest (the cache
        keys hold no key bytes). Pure."""
        digest = hashlib.sha256((self.job_uid or "").encode())
        if self.keyring is not None:
            for key_id in sorted(self.keyring.keys):
                digest.update(b"\0" + key_id.encode() + b"\0" + self.keyring.keys[key_id])
        return digest.hexdigest()


def fingerprint(objects: dict[str, Listed], *, who: str) -> str:
    """A step's verdict key: every object's path, size and ETag, and ``who``. Pure.
    Empty when an object has no ETag (a rewrite could not be told apart)."""
    digest = hashlib.sha256(who.encode())
    for path in sorted(objects):
        listed = objects[path]
        if not listed.etag:
            return ""
        digest.update(f"\0{path}\0{listed.size}\0{listed.etag}".encode())
    return digest.hexdigest()


def _crc32c(
    s3: S3Client, target: Target, key: str, listed: Listed, cache: EtagCache[str | None]
) -> str | None:
    hit, crc = cache.get(key, listed.etag)
    if hit:
        return crc
    try:
        _, crc = head_crc32c(s3, target.bucket, key)
    except ERRORS as error:
        raise failure(f"head of s3://{target.bucket}/{key}", error) from None
    cache.put(key, listed.etag, crc)
    return crc


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Reader:
    """One observe's S3 reads: the store, the caches, the bounds."""

    s3: S3Client
    target: Target
    caches: Caches
    deadline: Deadline
    bounds: tunables.S3

    def objects(
        self, step: int, objects: dict[str, Listed], wanted: set[str]
    ) -> dict[str, s3plan.RemoteObject]:
        """The step's objects; the ``wanted`` ones headed for their CRC32C."""
        seen: dict[str, s3plan.RemoteObject] = {}
        for path, item in objects.items():
            crc = None
            if path in wanted:
                self.deadline.check(f"the head of {path} in step {step}")
                key = self.target.key(step, path)
                crc = _crc32c(self.s3, self.target, key, item, self.caches.heads)
            seen[path] = s3plan.RemoteObject(size=item.size, crc32c=crc)
        return seen

    def manifest(self, step: int, listed: Listed) -> ManifestRead:
        self.deadline.check(f"reading the manifest of step {step}")
        return read_manifest(
            self.s3, self.target, step, listed_size=listed.size, bounds=self.bounds
        )

    def judged(
        self, step: int, objects: dict[str, Listed], who: Identity
    ) -> tuple[s3plan.Checked, dict[str, s3plan.RemoteObject]]:
        """The step's verdict, from the cache or judged now; the parsed manifest
        is dropped here, so a pass holds at most one at a time."""
        key = fingerprint(objects, who=who.digest())
        hit, known = self.caches.verdicts.get(str(step), key) if key else (False, None)
        if hit and known is not None:
            return known, self.objects(step, objects, set())
        read = self.manifest(step, objects[manifest_mod.MANIFEST_NAME])
        wanted = (
            s3plan.manifest_data_keys(read) if isinstance(read, manifest_mod.Manifest) else set()
        )
        seen = self.objects(step, objects, wanted)
        verdict = s3plan.verify_step(
            step=step, objects=seen, manifest=read, job_uid=who.job_uid, keyring=who.keyring
        )
        judged = s3plan.checked(verdict, read)
        if key:
            self.caches.verdicts.put(str(step), key, judged)
        return judged, seen


def observe(
    s3: S3Client,
    target: Target,
    *,
    caches: Caches | None = None,
    who: Identity | None = None,
    deadline: Deadline = NO_DEADLINE,
    bounds: tunables.S3 = tunables.DEFAULT.s3,
    sliced: bool = False,
) -> s3plan.Observation:
    """List the prefix (at most ``list_max_keys``); per step with a manifest, read
    it and head the files it lists. With ``who`` (the operator's pass), each
    step is judged here and only its verdict kept (``s3plan.Checked``), from
    the verdict cache while the step's objects are unchanged; without, the
    parsed manifests are returned (for callers that judge themselves).
    Raises ``StoreError`` (a store failure, too many keys, the deadline). With
    ``sliced`` (the operator's pass), at most ``list_pages_per_pass`` pages are
    listed, going on from ``caches.listing``, and ``ListingGoesOnError`` says the
    listing goes on in the next pass."""
    caches = caches or Caches()
    listed, aside = s3list.list_prefix(
        s3,
        target,
        max_keys=bounds.list_max_keys,
        deadline=deadline,
        slot=caches.listing if sliced else None,
        pages_per_pass=bounds.list_pages_per_pass if sliced else None,
        page_keys=bounds.list_page_keys,
        held_keys=bounds.list_held_keys,
    )
    reader = _Reader(s3=s3, target=target, caches=caches, deadline=deadline, bounds=bounds)
    listing: dict[int, dict[str, s3plan.RemoteObject]] = {}
    manifests: dict[int, ManifestRead] = {}
    for step, objects in listed.items():
        found = objects.get(manifest_mod.MANIFEST_NAME)
        if found is None:
            listing[step] = reader.objects(step, objects, set())
        elif who is not None:
            manifests[step], listing[step] = reader.judged(step, objects, who)
        else:
            manifests[step] = read = reader.manifest(step, found)
            wanted = (
                s3plan.manifest_data_keys(read)
                if isinstance(read, manifest_mod.Manifest)
                else set()
            )
            listing[step] = reader.objects(step, objects, wanted)
    return s3plan.Observation(listing=listing, manifests=manifests, aside_steps=aside)
