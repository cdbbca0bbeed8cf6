"""The pure parts of the operator's S3 caps: deadlines, verdict keys, cached verdicts, bounds.

Covers: a ``Deadline`` passes before its time and, after, raises a
``StoreError`` naming what it stopped before and its seconds (no deadline
never raises); a step's verdict key changes with any object's size or ETag
and with the job's identity, is empty when an object has no ETag (nothing
cached), and an identity digest changes with the keyring but never holds a
key's bytes; ``s3plan.checked`` keeps a verified step's listed paths and
nothing of a failed one; the plan takes a cached verdict as it is and a
retention deletion of a cached step removes exactly the paths its manifest
listed (the manifest first), never another attempt's objects; the bounds
reject zero caps and a ``slow_share`` out of (0, 1].
"""

import time
from typing import Any

import pytest

from cairn.api import checkpointspec
from cairn.api import manifest as manifest_mod
from cairn.operator import s3observe
from cairn.operator.core import s3plan, tunables


def test_deadline_raises_only_after_its_time() -> None:
    s3observe.NO_DEADLINE.check("anything")
    s3observe.Deadline.after(60.0).check("listing")
    late = s3observe.Deadline(time.monotonic() - 1.0, seconds=5.0)
    with pytest.raises(s3observe.StoreError, match=r"deadline \(5 s\) before the head of x"):
        late.check("the head of x")


def listed(**etags: str) -> dict[str, s3observe.Listed]:
    return {path: s3observe.Listed(size=10, etag=etag) for path, etag in etags.items()}


def test_verdict_key_follows_objects_and_identity() -> None:
    base = s3observe.fingerprint(listed(a="1", b="2"), who="job")
    assert base == s3observe.fingerprint(listed(b="2", a="1"), who="job")
    assert base != s3observe.fingerprint(listed(a="1", b="3"), who="job")
    assert base != s3observe.fingerprint(listed(a="1", b="2"), who="other")
    grown = {"a": s3observe.Listed(size=11, etag="1"), "b": s3observe.Listed(size=10, etag="2")}
    assert base != s3observe.fingerprint(grown, who="job")
    assert s3observe.fingerprint(listed(a="1", b=""), who="job") == ""


def test_identity_digest_changes_with_keys_and_holds_none() -> None:
    key = b"k" * 32
    ring = manifest_mod.Keyring(current="k1", keys={"k1": key})
    rotated = manifest_mod.Keyring(current="k2", keys={"k1": key, "k2": b"j" * 32})
    plain = s3observe.Identity(job_uid="uid-1")
    signed = s3observe.Identity(job_uid="uid-1", keyring=ring)
    assert len({plain.digest(), signed.digest()}) == 2
    assert signed.digest() != s3observe.Identity(job_uid="uid-1", keyring=rotated).digest()
    assert key.hex() not in signed.digest() and "kkkk" not in repr(signed)


OK = s3plan.Verdict(step=3, verified=True, method="crc32c", files=1, bytes=5)
BAD = s3plan.Verdict(step=4, verified=False, reason="a.bin is missing")


def manifest(step: int) -> manifest_mod.Manifest:
    entry = manifest_mod.FileEntry(path="a.bin", size=5, crc32c="00000000", rank=0)
    return manifest_mod.Manifest(step=step, world_size=1, attempt=1, created_at=0.0, files=(entry,))


def test_checked_keeps_paths_of_verified_steps_only() -> None:
    kept = s3plan.checked(OK, manifest(3))
    assert kept.verdict is OK and kept.paths == frozenset({"a.bin"})
    assert s3plan.checked(BAD, manifest(4)).paths == frozenset()
    assert s3plan.checked(BAD, s3plan.ManifestError(message="x")).paths == frozenset()


def test_plan_uses_cached_verdicts_and_deletes_exactly_listed_paths() -> None:
    objects = {
        "manifest.json": s3plan.RemoteObject(size=1),
        "a.bin": s3plan.RemoteObject(size=5),
        "a9-zombie/b.bin": s3plan.RemoteObject(size=5),
    }
    newer = s3plan.Verdict(step=5, verified=True, method="crc32c", files=1, bytes=5)
    todo = s3plan.plan(
        listing={3: objects, 4: objects, 5: objects},
        manifests={
            3: s3plan.checked(OK, manifest(3)),
            4: s3plan.Checked(verdict=BAD),
            5: s3plan.Checked(verdict=newer, paths=frozenset({"a.bin"})),
        },
        remote=checkpointspec.RemoteRetention(keep_last=1),
    )
    assert [v.step for v in todo.verdicts] == [3, 4, 5] and todo.failed == (BAD,)
    assert [(d.step, d.paths) for d in todo.deletions] == [(3, ("manifest.json", "a.bin"))]


@pytest.mark.parametrize("field", ["manifest_max_bytes", "manifest_max_entries", "list_max_keys"])
def test_s3_caps_must_be_positive(field: str) -> None:
    zero: dict[str, Any] = {field: 0}
    with pytest.raises(ValueError, match=field):
        tunables.S3(**zero)


@pytest.mark.parametrize("share", [0.0, 1.5])
def test_slow_share_must_be_a_fraction(share: float) -> None:
    with pytest.raises(ValueError, match="slow_share"):
        tunables.StorageLoop(slow_share=share)
