"""The thin effect of ``prefixplan``: read, create and release a prefix's owner object.

Blocking (boto3, the Kubernetes client for the credentials Secret): call from
a worker thread. ``open_prefix`` is the one entry point of the S3 pass and of
``onDelete``: the gates first (no client is built, no Secret read, no
request sent when one refuses): the settings, the endpoint's addresses
(``egress``), a prefix nested with an older job's (``prefixindex``); then
the claim. The owner object is
created with ``If-None-Match: *`` (SeaweedFS, MinIO and AWS S3 answer 412 when
it exists); a store that rejects conditional writes (501/400 on the header)
gets check-then-put, which is racy only between two jobs created in the same
instant, and says so in the log.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import typing

import botocore.exceptions

from cairn.api import s3owner, trainingjob
from cairn.operator import egress, kubeapi, prefixindex, s3observe
from cairn.operator.core import prefixplan

if typing.TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

LOG = logging.getLogger(__name__)
_ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)
_ABSENT = ("NoSuchKey", "404", "NotFound")
_TAKEN = ("PreconditionFailed", "ConditionalRequestConflict", "412", "409")
_UNSUPPORTED = ("NotImplemented", "501")


@functools.cache
def settings() -> prefixplan.Settings:
    """The operator's S3 settings, from its environment (the chart sets it)."""
    return prefixplan.Settings.from_env(os.environ)


class NotOwnedError(Exception):
    """The operator may not delete under the prefix (``claim`` says why)."""

    def __init__(self, claim: prefixplan.Claim) -> None:
        super().__init__(claim.message)
        self.claim = claim


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Access:
    """The claim, and a client for the prefix when the job owns it."""

    claim: prefixplan.Claim
    s3: S3Client | None
    target: s3observe.Target


def _code(error: botocore.exceptions.ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", "?"))


def owner_key(target: s3observe.Target) -> str:
    return f"{target.base}{s3owner.OWNER_KEY}"


def read_owner(s3: S3Client, target: s3observe.Target) -> s3owner.Owner | s3owner.Unreadable | None:
    key = owner_key(target)
    try:
        body = s3.get_object(Bucket=target.bucket, Key=key)["Body"].read(s3owner.OWNER_MAX_BYTES)
    except botocore.exceptions.ClientError as error:
        if _code(error) in _ABSENT:
            return None
        raise s3observe.StoreError(
            f"reading s3://{target.bucket}/{key} failed: {_code(error)}"
        ) from None
    except botocore.exceptions.BotoCoreError as error:
        raise s3observe.StoreError(f"reading s3://{target.bucket}/{key} failed: {error}") from None
    return s3owner.parse_owner(body)


def create_owner(s3: S3Client, target: s3observe.Target, owner: s3owner.Owner) -> bool:
    """Create the owner object if absent; False when another writer was first."""
    key = owner_key(target)
    try:
        s3.put_object(Bucket=target.bucket, Key=key, Body=owner.to_json(), IfNoneMatch="*")
        return True
    except botocore.exceptions.ClientError as error:
        code = _code(error)
        status = str(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        if code in _TAKEN or status in _TAKEN:
            return False
        if code not in _UNSUPPORTED and status not in _UNSUPPORTED:
            raise s3observe.StoreError(
                f"creating s3://{target.bucket}/{key} failed: {code}"
            ) from None
        LOG.warning("store rejected If-None-Match (%s); claiming %s by check-then-put", code, key)
    except botocore.exceptions.BotoCoreError as error:
        raise s3observe.StoreError(f"creating s3://{target.bucket}/{key} failed: {error}") from None
    if read_owner(s3, target) is not None:
        return False
    try:
        s3.put_object(Bucket=target.bucket, Key=key, Body=owner.to_json())
    except _ERRORS as error:
        raise s3observe.StoreError(f"creating s3://{target.bucket}/{key} failed: {error}") from None
    return True


def claim(s3: S3Client, target: s3observe.Target, me: s3owner.Owner) -> prefixplan.Claim:
    """Read the owner, create it when absent, and re-read after a lost race."""
    for _ in range(2):
        action, decided = prefixplan.decide(found=read_owner(s3, target), me=me)
        if action != "create" or create_owner(s3, target, me):
            return decided
    return prefixplan.claim_failed("the owner object appeared and vanished while claiming")


def me(job: trainingjob.TrainingJob) -> s3owner.Owner:
    meta = job.metadata
    return s3owner.Owner(uid=meta.uid, namespace=meta.namespace, name=meta.name)


def open_prefix(
    *,
    api: kubeapi.KubeApi,
    job: trainingjob.TrainingJob,
    config: prefixplan.Settings | None = None,
    index: prefixindex.PrefixIndex | None = None,
) -> Access:
    """The gates, then the claim. Raises ``s3observe.StoreError`` on I/O failures."""
    upload = job.spec.checkpoint.upload
    if upload is None:
        raise ValueError("open_prefix needs spec.checkpoint.upload")
    target = s3observe.Target.parse(upload.uri)
    config = config or settings()
    mine = prefixplan.PrefixUse.of(job, claim_reason=None)
    others = (index or prefixindex.INDEX).sharing(mine) if mine is not None else ()
    refused = (
        prefixplan.access_refusal(upload, config)
        or egress.refusal(upload, config, job=f"{job.metadata.namespace}/{job.metadata.name}")
        or (prefixplan.nested_refusal(mine=mine, others=others) if mine is not None else None)
    )
    if refused is not None:
        return Access(claim=refused, s3=None, target=target)
    s3 = s3observe.client_for(api, job.metadata.namespace, upload, job_uid=job.metadata.uid)
    decided = claim(s3, target, me(job))
    return Access(claim=decided, s3=s3 if decided.owned else None, target=target)


def release(s3: S3Client, target: s3observe.Target, owner: s3owner.Owner) -> bool:
    """Delete the owner object if it is still ours (after ``onDelete: Delete``)."""
    if read_owner(s3, target) != owner:
        return False
    try:
        s3.delete_object(Bucket=target.bucket, Key=owner_key(target))
    except _ERRORS as error:
        raise s3observe.StoreError(f"releasing {owner_key(target)} failed: {error}") from None
    return True
