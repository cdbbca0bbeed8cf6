"""s3observe's caches: S3 clients per (endpoint, region, key pair), values per (key, ETag).

Covers: the same store and key pair share one client (built once); a rotated
secret key, another access key, another endpoint or region each get their
own; the cache key holds a digest, never the secret; past its limit the least
recently used client goes; an ``EtagCache`` answers a hit only for the same
(key, ETag), remembers a None value as a hit, and starts over at its limit.
"""

from cairn.api import checkpointspec
from cairn.operator import s3observe

UPLOAD = checkpointspec.UploadSpec(uri="s3://bucket/runs/a", endpoint="http://127.0.0.1:1")


def test_same_store_and_pair_share_one_client() -> None:
    cache = s3observe.ClientCache(limit=8)
    first = cache.get(UPLOAD, access_key="ak", secret_key="sk")
    again = cache.get(
        checkpointspec.UploadSpec(uri="s3://bucket/runs/b", endpoint="http://127.0.0.1:1"),
        access_key="ak",
        secret_key="sk",
    )
    assert again is first and cache.builds == 1


def test_rotated_or_other_credentials_or_store_get_their_own_client() -> None:
    cache = s3observe.ClientCache(limit=8)
    base = cache.get(UPLOAD, access_key="ak", secret_key="sk")
    rotated = cache.get(UPLOAD, access_key="ak", secret_key="sk2")
    other_key = cache.get(UPLOAD, access_key="ak2", secret_key="sk")
    other_store = cache.get(
        checkpointspec.UploadSpec(uri="s3://bucket/a", endpoint="http://127.0.0.1:2"),
        access_key="ak",
        secret_key="sk",
    )
    other_region = cache.get(
        checkpointspec.UploadSpec(
            uri="s3://bucket/a", endpoint="http://127.0.0.1:1", region="eu-x-1"
        ),
        access_key="ak",
        secret_key="sk",
    )
    clients = [base, rotated, other_key, other_store, other_region]
    assert len({id(c) for c in clients}) == 5 and cache.builds == 5
    # Back to the first pair: still cached.
    assert cache.get(UPLOAD, access_key="ak", secret_key="sk") is base
    assert cache.builds == 5


def test_cache_key_holds_no_secret() -> None:
    key = s3observe.client_key(UPLOAD, access_key="ak", secret_key="very-secret")
    assert "very-secret" not in repr(key)
    assert key[:3] == ("http://127.0.0.1:1", "us-east-1", "ak")
    assert key != s3observe.client_key(UPLOAD, access_key="ak", secret_key="other")


def test_least_recently_used_client_goes_past_the_limit() -> None:
    cache = s3observe.ClientCache(limit=2)
    a = cache.get(UPLOAD, access_key="a", secret_key="s")
    b = cache.get(UPLOAD, access_key="b", secret_key="s")
    assert cache.get(UPLOAD, access_key="a", secret_key="s") is a  # a is now the newest
    cache.get(UPLOAD, access_key="c", secret_key="s")  # evicts b
    assert cache.get(UPLOAD, access_key="a", secret_key="s") is a
    assert cache.get(UPLOAD, access_key="b", secret_key="s") is not b
    assert cache.builds == 4


def test_etag_cache_hits_only_the_same_key_and_etag() -> None:
    cache: s3observe.EtagCache[str | None] = s3observe.EtagCache(limit=3)
    cache.put("k", '"e1"', None)
    assert cache.get("k", '"e1"') == (True, None)  # "no CRC32C" is an answer too
    assert cache.get("k", '"e2"') == (False, None)
    assert cache.get("other", '"e1"') == (False, None)
    cache.put("k2", '"e"', "aa")
    cache.put("k3", '"e"', "bb")
    cache.put("k4", '"e"', "cc")  # the limit: starts over
    assert len(cache) == 1 and cache.get("k4", '"e"') == (True, "cc")
