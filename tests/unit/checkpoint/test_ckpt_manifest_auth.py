"""Authenticated manifests (cairn.api.manifest: canonical bytes, sign, verify, authenticate).

Covers: canonical bytes are deterministic, cover every field but the
signature (unknown fields too) and survive a JSON round trip; a signed
manifest verifies with its keyring; each tampered field (step, job UID,
attempt, world size, a file's path/size/CRC32C/rank, data_prefix, lineage,
an added unknown field) breaks the signature; a wrong key, a missing
signature, an unknown key id, an unknown algorithm do not verify; rotation
(a step signed with an older key id still verifies, new steps use the new
one; a key id cannot be reused); a manifest without job_uid or of another job
is foreign with and without a keyring; without a keyring and without a job
UID (library use) every manifest is ours; the keyring file round trips and
its repr and parse errors never show key bytes.
"""

from __future__ import annotations

import pytest

from cairn.api import manifest

UID = "1f0e2d3c-aaaa-bbbb-cccc-000000000001"
KEY_A = bytes(range(32))
KEY_B = bytes(range(1, 33))


def make(**overrides: object) -> manifest.Manifest:
    doc: dict[str, object] = {
        "step": 120,
        "world_size": 2,
        "attempt": 3,
        "created_at": 1764205200.123456,
        "files": [
            {"path": ".metadata", "size": 70, "crc32c": "0000abcd", "rank": 0},
            {"path": "__0_0.distcp", "size": 1024, "crc32c": "12345678", "rank": 0},
            {"path": "__1_0.distcp", "size": 1024, "crc32c": "9abcdef0", "rank": 1},
        ],
        "job_uid": UID,
        "lineage": "1f0e2d3c-a3",
        "data_prefix": "a3-1f0e2d3c",
    }
    doc.update(overrides)
    return manifest.Manifest.model_validate(doc)


RING = manifest.Keyring(current="k1", keys={"k1": KEY_A})


def test_canonical_bytes_are_deterministic_and_exclude_only_the_signature() -> None:
    plain = make()
    signed = manifest.sign(plain, RING)
    assert manifest.canonical_bytes(plain) == manifest.canonical_bytes(signed)
    assert b"signature" not in manifest.canonical_bytes(signed)
    for needle in (b'"job_uid"', b'"lineage"', b'"data_prefix"', b'"crc32c"', b'"world_size"'):
        assert needle in manifest.canonical_bytes(plain)
    # The JSON written to disk parses back to the same canonical bytes.
    again = manifest.parse_manifest(manifest.dump_manifest(signed))
    assert manifest.canonical_bytes(again) == manifest.canonical_bytes(signed)
    assert manifest.verify(again, RING).own


def test_signed_manifest_verifies_and_records_the_current_key_id() -> None:
    signed = manifest.sign(make(), RING)
    assert signed.signature is not None
    assert signed.signature.alg == "hmac-sha256"
    assert signed.signature.key_id == "k1"
    assert len(signed.signature.mac) == 64
    found = manifest.authenticate(signed, job_uid=UID, keyring=RING)
    assert (found.own, found.signed, found.reason) == (True, True, "")


def _files(**change: object) -> list[dict[str, object]]:
    files: list[dict[str, object]] = [
        {"path": ".metadata", "size": 70, "crc32c": "0000abcd", "rank": 0},
        {"path": "__0_0.distcp", "size": 1024, "crc32c": "12345678", "rank": 0},
        {"path": "__1_0.distcp", "size": 1024, "crc32c": "9abcdef0", "rank": 1},
    ]
    files[1] = {**files[1], **change}
    return files


@pytest.mark.parametrize(
    "tamper",
    [
        {"step": 121},
        {"attempt": 4},
        {"world_size": 4},
        {"created_at": 1.0},
        {"job_uid": "someone-else"},
        {"lineage": "ffffffff-a9"},
        {"data_prefix": "a9-ffffffff"},
        {"files": _files(size=1025)},
        {"files": _files(crc32c="00000000")},
        {"files": _files(path="__9_0.distcp")},
        {"files": _files(rank=1)},
        {"files": _files()[:2]},
        {"extra": {"write_seconds": 9.0}},
        {"added_later": "x"},
    ],
    ids=lambda t: next(iter(t)) if isinstance(t, dict) else str(t),
)
def test_tampered_field_breaks_the_signature(tamper: dict[str, object]) -> None:
    signature = manifest.sign(make(), RING).signature
    forged = make(**tamper).model_copy(update={"signature": signature})
    found = manifest.verify(forged, RING)
    assert not found.own
    assert "does not verify" in found.reason


def test_wrong_key_does_not_verify() -> None:
    signed = manifest.sign(make(), manifest.Keyring(current="k1", keys={"k1": KEY_B}))
    found = manifest.authenticate(signed, job_uid=UID, keyring=RING)
    assert not found.own
    assert "does not verify" in found.reason


def test_missing_signature_is_foreign_when_the_job_has_a_key() -> None:
    found = manifest.authenticate(make(), job_uid=UID, keyring=RING)
    assert (found.own, found.reason) == (False, "manifest is not signed")


def test_unknown_key_id_and_unknown_algorithm_do_not_verify() -> None:
    other = manifest.sign(make(), manifest.Keyring(current="k7", keys={"k7": KEY_A}))
    assert "key id 'k7'" in manifest.verify(other, RING).reason
    assert other.signature is not None
    odd = other.model_copy(
        update={"signature": other.signature.model_copy(update={"alg": "hmac-md5", "key_id": "k1"})}
    )
    assert "unknown signature algorithm" in manifest.verify(odd, RING).reason


def test_rotation_keeps_older_key_ids_verifying() -> None:
    old_step = manifest.sign(make(step=100), RING)
    ring2 = manifest.rotated(RING, key_id="k2", key=KEY_B)
    new_step = manifest.sign(make(step=200), ring2)
    assert new_step.signature is not None and new_step.signature.key_id == "k2"
    assert manifest.authenticate(old_step, job_uid=UID, keyring=ring2).own
    assert manifest.authenticate(new_step, job_uid=UID, keyring=ring2).own
    # The pre-rotation keyring cannot verify what the new key signed.
    assert not manifest.authenticate(new_step, job_uid=UID, keyring=RING).own
    with pytest.raises(ValueError, match="already in the keyring"):
        manifest.rotated(ring2, key_id="k1", key=KEY_B)


def test_no_job_uid_is_foreign_with_and_without_a_keyring() -> None:
    anonymous = make(job_uid=None)
    signed = manifest.sign(anonymous, RING)
    assert manifest.verify(signed, RING).own  # the MAC is fine...
    found = manifest.authenticate(signed, job_uid=UID, keyring=RING)
    assert not found.own  # ...but it does not say it is this job's
    assert "no job UID" in found.reason
    unkeyed = manifest.authenticate(anonymous, job_uid=UID, keyring=None)
    assert not unkeyed.own
    assert "no job UID" in unkeyed.reason


def test_another_jobs_signed_manifest_is_foreign() -> None:
    theirs = manifest.sign(
        make(job_uid="0000aaaa-other"), manifest.Keyring(current="k1", keys={"k1": KEY_B})
    )
    assert not manifest.authenticate(theirs, job_uid=UID, keyring=RING).own
    # Even a manifest signed with our key but naming another job is not ours.
    ours_key = manifest.sign(make(job_uid="0000aaaa-other"), RING)
    found = manifest.authenticate(ours_key, job_uid=UID, keyring=RING)
    assert not found.own
    assert "0000aaaa-other" in found.reason


def test_without_a_keyring_unsigned_manifests_of_this_job_are_accepted() -> None:
    found = manifest.authenticate(make(), job_uid=UID, keyring=None)
    assert (found.own, found.signed) == (True, False)
    # Library use (no UID, no key): every manifest is ours, as before.
    assert manifest.authenticate(make(job_uid=None), job_uid=None, keyring=None).own


def test_keyring_file_round_trips_and_never_shows_a_key() -> None:
    ring2 = manifest.rotated(RING, key_id="k2", key=KEY_B)
    again = manifest.parse_keyring(manifest.dump_keyring(ring2))
    assert again == ring2
    assert KEY_A.hex() not in repr(ring2) and KEY_B.hex() not in repr(ring2)
    assert repr(ring2) == "Keyring(current='k2', ids=['k1', 'k2'])"
    bad = b'{"current": "k1", "keys": {"k1": "zz' + KEY_A.hex().encode() + b'"}}'
    with pytest.raises(ValueError) as info:
        manifest.parse_keyring(bad)
    assert KEY_A.hex() not in str(info.value)


@pytest.mark.parametrize(
    ("current", "keys", "message"),
    [
        ("k9", {"k1": KEY_A}, "not among the keys"),
        ("k1", {"k1": b"short"}, "shorter than"),
        ("../k", {"../k": KEY_A}, "must match"),
    ],
)
def test_keyring_refuses_bad_shapes(current: str, keys: dict[str, bytes], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        manifest.Keyring(current=current, keys=keys)
