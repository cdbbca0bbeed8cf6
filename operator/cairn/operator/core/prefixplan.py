"""Who may touch a job's S3 prefix: the operator's S3 settings and the prefix's owner.

Pure: settings, the job's upload spec and the owner object's content in, a
``Claim`` out. ``prefixapply`` reads and writes the owner object and builds
the S3 client; ``storage`` records the claim in ``status.storage.claim``;
``status`` turns it into the ``StorageRefused`` condition.

Two gates, checked before any S3 call:

1. Access (confused deputy, SSRF): a job without
   ``upload.credentialsSecretRef`` would make the operator use its own
   identity on a bucket the user chose; refused unless
   ``Settings.allow_operator_identity``. A job's ``upload.endpoint`` must be
   in ``Settings.endpoint_allow_list`` when that list is not empty; one that
   is not listed must not be (or resolve to) loopback, link-local or the
   cluster's networks (``egressplan``, ``Settings.cluster_networks``).
2. Ownership: a job claims its prefix by creating ``<prefix>/.cairn/owner.json``
   (its UID, namespace and name) with ``If-None-Match: *``. The operator
   verifies, applies retention and ``onDelete: Delete`` only under a prefix
   the job owns; a second job aimed at an owned prefix gets
   ``StorageRefused`` (reason ``PrefixOwnedByAnotherJob``, naming the owner)
   and its pods may still read from the prefix (``resume.uri``). A prefix
   inside or around another job's prefix on the same store and bucket
   (``nested_refusal``; the operator's own view of every TrainingJob,
   ``prefixindex``, never the untrusted owner objects) is refused too: the
   older job keeps it (``PrefixNested``, naming it), since the outer job's
   retention and ``onDelete`` would otherwise reach the inner job's steps.
"""

import dataclasses
import ipaddress
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from cairn.api import checkpointspec, jobstatus, s3owner, trainingjob
from cairn.operator.core import conditions, k8stypes

ENV_ALLOW_OPERATOR_IDENTITY = "CAIRN_S3_ALLOW_OPERATOR_IDENTITY"
ENV_ENDPOINT_ALLOW_LIST = "CAIRN_S3_ENDPOINT_ALLOWLIST"
ENV_CLUSTER_NETWORKS = "CAIRN_S3_CLUSTER_NETWORKS"
DEFAULT_CLUSTER_NETWORKS: tuple[str, ...] = ("10.96.0.0/12", "10.244.0.0/16")
"""kubeadm's default Service range and the common pod range (flannel); the
chart's ``s3.clusterNetworks`` names the cluster's real ones."""

# Reasons (condition reasons and Event reasons).
REASON_OWNED = "PrefixOwned"
REASON_FOREIGN = "PrefixOwnedByAnotherJob"
REASON_IDENTITY = "OperatorIdentityNotAllowed"
REASON_ENDPOINT = "EndpointNotAllowed"
REASON_UNREADABLE = "OwnerUnreadable"
REASON_CLAIM_FAILED = "ClaimFailed"
REASON_NOT_CLAIMED = "NotClaimedYet"
REASON_NESTED = "PrefixNested"
REASON_ADDRESS = "EndpointAddressRefused"
ACCESS_REASONS = frozenset({REASON_IDENTITY, REASON_ENDPOINT, REASON_ADDRESS})
"""Refusals before any S3 call: such a job never works in its prefix."""

Action = Literal["use", "create", "refuse"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """The operator's S3 configuration (chart values ``s3.*``)."""

    allow_operator_identity: bool = False
    endpoint_allow_list: tuple[str, ...] = ()
    """Origins (``scheme://host[:port]``); empty: any endpoint not on a refused
    network. A listed origin is exempt from the network check."""
    cluster_networks: tuple[str, ...] = DEFAULT_CLUSTER_NETWORKS
    """CIDRs of the cluster's Services and pods, refused as endpoints (beside
    loopback and link-local, always refused) unless allow-listed."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "Settings":
        """ValueError naming the variable when a network is not a CIDR."""
        allow = environ.get(ENV_ALLOW_OPERATOR_IDENTITY, "").strip().lower() in ("1", "true", "yes")
        listed = environ.get(ENV_ENDPOINT_ALLOW_LIST, "")
        networks = DEFAULT_CLUSTER_NETWORKS
        if ENV_CLUSTER_NETWORKS in environ:
            networks = tuple(
                n.strip() for n in environ[ENV_CLUSTER_NETWORKS].split(",") if n.strip()
            )
        for text in networks:
            try:
                ipaddress.ip_network(text, strict=False)
            except ValueError:
                raise ValueError(f"{ENV_CLUSTER_NETWORKS}: {text!r} is not a CIDR") from None
        return cls(
            allow_operator_identity=allow,
            endpoint_allow_list=tuple(e.strip() for e in listed.split(",") if e.strip()),
            cluster_networks=networks,
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Claim:
    """Whether the operator may work under the job's prefix, and why (not)."""

    owned: bool
    reason: str
    message: str

    def status(self) -> dict[str, object]:
        """As ``status.storage.claim``."""
        return {"owned": self.owned, "reason": self.reason, "message": self.message}


def _origin(url: str) -> tuple[str, str, int] | None:
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    return parts.scheme, parts.hostname.lower(), port


def allow_listed(endpoint: str, settings: Settings) -> bool:
    """Whether the endpoint's origin is in the allow-list (default ports, host case). Pure."""
    origin = _origin(endpoint)
    return origin is not None and origin in {_origin(e) for e in settings.endpoint_allow_list}


def access_refusal(upload: checkpointspec.UploadSpec, settings: Settings) -> Claim | None:
    """Why the operator must not call the job's store at all, or None."""
    if upload.credentials_secret_ref is None and not settings.allow_operator_identity:
        return Claim(
            owned=False,
            reason=REASON_IDENTITY,
            message="upload.credentialsSecretRef is not set and the operator's configuration "
            "does not let it use its own identity (s3.allowOperatorIdentity): no verification, "
            "retention or onDelete in S3",
        )
    listed = settings.endpoint_allow_list
    if upload.endpoint is not None and listed and not allow_listed(upload.endpoint, settings):
        return Claim(
            owned=False,
            reason=REASON_ENDPOINT,
            message=f"upload.endpoint {upload.endpoint} is not in the operator's endpoint "
            f"allow-list ({', '.join(settings.endpoint_allow_list)}): no S3 call made",
        )
    return None


def decide(
    *, found: s3owner.Owner | s3owner.Unreadable | None, me: s3owner.Owner
) -> tuple[Action, Claim]:
    """What to do given the owner object as read (None: absent). Pure.

    The UID decides: a job recreated under the same name is another job
    (its predecessor's checkpoints are not its to delete).
    """
    if found is None:
        return "create", Claim(owned=True, reason=REASON_OWNED, message="prefix claimed")
    if isinstance(found, s3owner.Unreadable):
        return "refuse", Claim(
            owned=False,
            reason=REASON_UNREADABLE,
            message=f"{s3owner.OWNER_KEY} under the prefix cannot be read ({found.why}); "
            "the operator does not touch a prefix whose owner it cannot tell",
        )
    if found.uid == me.uid:
        return "use", Claim(owned=True, reason=REASON_OWNED, message="prefix owned by this job")
    return "refuse", Claim(
        owned=False,
        reason=REASON_FOREIGN,
        message=f"the prefix is owned by TrainingJob {found.describe()}: this job's operator "
        "side does not verify, apply retention or delete there (its pods may still read it)",
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PrefixUse:
    """One job's upload prefix as the operator's own cache of TrainingJobs has it."""

    uid: str
    namespace: str
    name: str
    created: str
    """``metadata.creationTimestamp`` (ISO 8601, UTC): the older job keeps a prefix."""
    origin: tuple[str, str, int] | None
    """The endpoint's origin; None: the SDK's default (AWS) endpoint."""
    bucket: str
    base: str
    """Key prefix with a trailing slash, '' for the whole bucket."""
    gave_up: bool = False
    """Its recorded claim was refused before any S3 call (``ACCESS_REASONS``)."""

    @classmethod
    def of(cls, job: trainingjob.TrainingJob, *, claim_reason: str | None) -> "PrefixUse | None":
        """None for a job without ``upload``. Pure."""
        upload = job.spec.checkpoint.upload
        if upload is None:
            return None
        bucket, prefix = checkpointspec.split_s3_uri(upload.uri)
        meta = job.metadata
        created = meta.creation_timestamp
        return cls(
            uid=meta.uid,
            namespace=meta.namespace,
            name=meta.name,
            created=created.isoformat() if created is not None else "",
            origin=_origin(upload.endpoint) if upload.endpoint is not None else None,
            bucket=bucket,
            base=f"{prefix}/" if prefix else "",
            gave_up=claim_reason in ACCESS_REASONS,
        )

    @property
    def store(self) -> tuple[tuple[str, str, int] | None, str]:
        """Same store and bucket: (origin, bucket)."""
        return self.origin, self.bucket

    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.base}"


def nested(one: PrefixUse, other: PrefixUse) -> bool:
    """One prefix strictly inside the other on the same store and bucket (``a/b/``
    is inside ``a/``; ``a/bc/`` is not inside ``a/b/``). Equal prefixes are the owner
    object's business (``decide``). Pure."""
    if one.store != other.store or one.base == other.base:
        return False
    return one.base.startswith(other.base) or other.base.startswith(one.base)


def _age_rank(use: PrefixUse) -> tuple[str, str]:
    """Older first; a job without a creation time (not yet stored) last."""
    return use.created or "~", use.uid


def nested_refusal(*, mine: PrefixUse, others: Iterable[PrefixUse]) -> Claim | None:
    """Refused when an older job's prefix is inside or around ``mine``. Pure.

    Older (creation time, then UID) keeps it, so a job created later can never
    take a running job's prefix from it; a job refused before any S3 call
    (``gave_up``) keeps nothing.
    """
    blockers = [
        other
        for other in others
        if other.uid != mine.uid
        and not other.gave_up
        and nested(mine, other)
        and _age_rank(other) < _age_rank(mine)
    ]
    if not blockers:
        return None
    first = min(blockers, key=_age_rank)
    where = "inside" if mine.base.startswith(first.base) else "around"
    return Claim(
        owned=False,
        reason=REASON_NESTED,
        message=f"the upload prefix {mine.uri()} is {where} the prefix {first.uri()} of "
        f"TrainingJob {first.namespace}/{first.name}: one job's retention and onDelete would "
        "reach the other's checkpoints; choose a prefix beside it",
    )


def claim_failed(why: str) -> Claim:
    return Claim(owned=False, reason=REASON_CLAIM_FAILED, message=f"claiming the prefix: {why}")


def with_claim(
    patch: dict[str, Any] | None,
    notices: tuple[k8stypes.Event, ...],
    *,
    previous: jobstatus.StorageStatus | None,
    claim: Claim | None,
) -> tuple[dict[str, Any] | None, tuple[k8stypes.Event, ...]]:
    """The S3 pass's ``status.storage`` patch and events with the claim added. Pure.

    ``claim`` None: not decided this pass (the store failed first); nothing
    changes. A claim that turns refused (or changes its reason) posts one
    Warning Event with the reason; one that turns owned, a Normal one.
    """
    before = previous.claim if previous is not None else None
    if claim is None or (
        before is not None
        and (before.owned, before.reason, before.message)
        == (claim.owned, claim.reason, claim.message)
    ):
        return patch, notices
    merged = {**(patch or {}), "claim": claim.status()}
    if before is not None and (before.owned, before.reason) == (claim.owned, claim.reason):
        return merged, notices
    notice = k8stypes.Event(
        type="Normal" if claim.owned else "Warning", reason=claim.reason, message=claim.message
    )
    return merged, (*notices, notice)


def condition(storage: jobstatus.StorageStatus | None) -> conditions.Desired:
    """``StorageRefused`` from what the S3 pass recorded in ``status.storage.claim``. Pure."""
    claim = storage.claim if storage is not None else None
    if claim is None:
        return conditions.Desired(
            type=conditions.STORAGE_REFUSED, status=False, reason=REASON_NOT_CLAIMED
        )
    return conditions.Desired(
        type=conditions.STORAGE_REFUSED,
        status=not claim.owned,
        reason=claim.reason,
        message="" if claim.owned else claim.message,
    )
