"""S3 prefix ownership and the operator's S3 settings, as pure decisions.

Covers: settings from the environment (identity off by default, the
allow-list split and trimmed); the access gate (no Secret reference without
the identity setting, an endpoint outside a non-empty allow-list, default
ports and host case when comparing origins, an empty list allowing any);
``decide`` on an absent, our own, another job's (same name, another UID)
and an unreadable owner object; the ``status.storage.claim`` patch and its
Events (once per change of reason, none when unchanged); the
``StorageRefused`` condition from the recorded claim.
"""

import pytest

from cairn.api import checkpointspec, jobstatus, s3owner
from cairn.operator.core import conditions, prefixplan

ME = s3owner.Owner(uid="u-1", namespace="ml", name="a")


def upload(**fields: object) -> checkpointspec.UploadSpec:
    return checkpointspec.UploadSpec.model_validate({"uri": "s3://bucket/prefix", **fields})


WITH_SECRET = {"credentialsSecretRef": {"name": "s3"}}


def test_settings_from_env() -> None:
    assert prefixplan.Settings.from_env({}) == prefixplan.Settings()
    got = prefixplan.Settings.from_env(
        {
            prefixplan.ENV_ALLOW_OPERATOR_IDENTITY: "true",
            prefixplan.ENV_ENDPOINT_ALLOW_LIST: " http://a:1 ,,https://b ",
        }
    )
    assert got == prefixplan.Settings(
        allow_operator_identity=True, endpoint_allow_list=("http://a:1", "https://b")
    )


@pytest.mark.parametrize(
    ("spec", "settings", "reason"),
    [
        ({}, prefixplan.Settings(), prefixplan.REASON_IDENTITY),
        ({}, prefixplan.Settings(allow_operator_identity=True), None),
        (WITH_SECRET, prefixplan.Settings(), None),
        (
            {**WITH_SECRET, "endpoint": "http://169.254.169.254"},
            prefixplan.Settings(endpoint_allow_list=("http://10.0.0.1:9000",)),
            prefixplan.REASON_ENDPOINT,
        ),
        (
            {**WITH_SECRET, "endpoint": "http://MINIO.local/"},
            prefixplan.Settings(endpoint_allow_list=("http://minio.local:80",)),
            None,
        ),
        (
            {**WITH_SECRET, "endpoint": "https://minio.local:9000"},
            prefixplan.Settings(endpoint_allow_list=("http://minio.local:9000",)),
            prefixplan.REASON_ENDPOINT,
        ),
        ({**WITH_SECRET, "endpoint": "http://anything:1"}, prefixplan.Settings(), None),
    ],
    ids=[
        "identity-off",
        "identity-on",
        "secret",
        "endpoint-not-listed",
        "endpoint-default-port-and-case",
        "endpoint-scheme-differs",
        "empty-list-allows-any",
    ],
)
def test_access_gate(
    spec: dict[str, object], settings: prefixplan.Settings, reason: str | None
) -> None:
    refused = prefixplan.access_refusal(upload(**spec), settings)
    assert (refused.reason if refused else None) == reason
    if refused is not None:
        assert not refused.owned and refused.message


def test_decide() -> None:
    assert prefixplan.decide(found=None, me=ME)[0] == "create"
    action, claim = prefixplan.decide(found=ME, me=ME)
    assert (action, claim.owned) == ("use", True)
    twin = s3owner.Owner(uid="u-2", namespace="ml", name="a")  # recreated: another job
    action, claim = prefixplan.decide(found=twin, me=ME)
    assert (action, claim.owned, claim.reason) == ("refuse", False, prefixplan.REASON_FOREIGN)
    assert "ml/a (uid u-2)" in claim.message
    action, claim = prefixplan.decide(found=s3owner.parse_owner(b"{not json"), me=ME)
    assert (action, claim.reason) == ("refuse", prefixplan.REASON_UNREADABLE)


def test_owner_round_trip() -> None:
    assert s3owner.parse_owner(ME.to_json()) == ME
    assert isinstance(s3owner.parse_owner(b'{"uid": "x"}'), s3owner.Unreadable)


def _storage(claim: prefixplan.Claim | None) -> jobstatus.StorageStatus:
    return jobstatus.StorageStatus.model_validate({"claim": claim.status() if claim else None})


FOREIGN = prefixplan.decide(found=s3owner.Owner(uid="x", namespace="o", name="b"), me=ME)[1]
OWNED = prefixplan.decide(found=ME, me=ME)[1]


def test_with_claim_patches_and_announces_changes_once() -> None:
    patch, notices = prefixplan.with_claim({"lastError": None}, (), previous=None, claim=FOREIGN)
    assert patch == {"lastError": None, "claim": FOREIGN.status()}
    assert [(n.type, n.reason) for n in notices] == [("Warning", prefixplan.REASON_FOREIGN)]
    same = prefixplan.with_claim(None, (), previous=_storage(FOREIGN), claim=FOREIGN)
    assert same == (None, ())
    patch, notices = prefixplan.with_claim(None, (), previous=_storage(FOREIGN), claim=OWNED)
    assert patch == {"claim": OWNED.status()}
    assert [(n.type, n.reason) for n in notices] == [("Normal", prefixplan.REASON_OWNED)]
    assert prefixplan.with_claim(None, (), previous=_storage(OWNED), claim=None) == (None, ())


def test_condition() -> None:
    refused = prefixplan.condition(_storage(FOREIGN))
    assert (refused.type, refused.status, refused.reason) == (
        conditions.STORAGE_REFUSED,
        True,
        prefixplan.REASON_FOREIGN,
    )
    owned = prefixplan.condition(_storage(OWNED))
    assert (owned.status, owned.reason, owned.message) == (False, prefixplan.REASON_OWNED, "")
    assert prefixplan.condition(None).reason == prefixplan.REASON_NOT_CLAIMED
