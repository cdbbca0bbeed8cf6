"""The operator's tunables object and its one time format.

Covers: the defaults are valid and are what the S3 pass runs with; a
non-positive bound or an over-large delete batch is refused naming the field;
an S3 client built with other bounds carries them (timeouts, attempts,
default region); ``clock.rfc3339`` writes UTC with whole seconds whatever the
input's zone and microseconds, and ``rfc3339_or_none`` passes None through.
"""

import datetime
from typing import Any

import pytest

from cairn.api import checkpointspec
from cairn.operator import s3observe
from cairn.operator.core import clock, tunables


def test_defaults_are_valid_and_used() -> None:
    defaults = tunables.Settings()
    assert defaults == tunables.DEFAULT
    assert defaults.s3.delete_batch == 1000
    assert defaults.storage.cleanup_attempts == 5


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: tunables.S3(max_attempts=0), "S3.max_attempts"),
        (lambda: tunables.S3(read_timeout_seconds=-1.0), "S3.read_timeout_seconds"),
        (lambda: tunables.S3(delete_batch=1001), "S3.delete_batch"),
        (lambda: tunables.StorageLoop(threads=0), "StorageLoop.threads"),
        (lambda: tunables.StorageLoop(interval_seconds=0.0), "StorageLoop.interval_seconds"),
    ],
)
def test_bad_bounds_are_refused_naming_the_field(build: object, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        build()  # type: ignore[operator]


def test_client_carries_the_bounds_it_was_given() -> None:
    upload = checkpointspec.UploadSpec(uri="s3://bucket/prefix", endpoint="http://127.0.0.1:1")
    bounds = tunables.S3(
        max_attempts=2,
        connect_timeout_seconds=1.5,
        read_timeout_seconds=3.0,
        default_region="eu-x-1",
    )
    s3 = s3observe.make_client(upload, access_key="a", secret_key="b", bounds=bounds)
    config: Any = s3.meta.config  # botocore's Config has no attribute stubs
    assert (config.connect_timeout, config.read_timeout) == (1.5, 3.0)
    # botocore counts the first call too: max_attempts retries = 1 + 2 calls.
    assert config.retries == {"mode": "standard", "total_max_attempts": 3}
    assert s3.meta.region_name == "eu-x-1"


def test_rfc3339_is_utc_whole_seconds() -> None:
    zone = datetime.timezone(datetime.timedelta(hours=2))
    value = datetime.datetime(2026, 11, 23, 14, 0, 5, 999_999, tzinfo=zone)
    assert clock.rfc3339(value) == "2026-11-23T12:00:05Z"
    assert clock.rfc3339_or_none(None) is None
    assert clock.rfc3339_or_none(value) == "2026-11-23T12:00:05Z"
