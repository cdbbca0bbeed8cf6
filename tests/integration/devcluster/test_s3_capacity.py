"""The devcluster's S3 server takes as many buckets as a test run makes.

Every bucket is a SeaweedFS collection with at least one volume of its own,
and `weed mini` caps volumes at free disk / 1 GiB unless told otherwise: with
55 GiB free, the 56th bucket's first PUT failed with "No writable volumes"
(InternalError) and every S3 test after it failed. `s3.command` sets the cap.
"""

from __future__ import annotations

import pathlib
import shutil
from typing import Any

import pytest

from cairn.devcluster import s3, standalone_s3

pytestmark = pytest.mark.s3

CAPACITY_TEST_PORT = 24333


def test_more_buckets_than_free_disk_gib_are_writable(tmp_path: pathlib.Path) -> None:
    free_gib = shutil.disk_usage(tmp_path).free // 2**30
    # Past the old default cap on this disk, bounded for machines with huge disks.
    buckets = min(free_gib + 5, 150)
    assert buckets < s3.MAX_VOLUMES
    server = standalone_s3.start(root=tmp_path / "s3", s3_port=CAPACITY_TEST_PORT)
    try:
        client: Any = server.client()
        for i in range(buckets):
            client.create_bucket(Bucket=f"cap-{i}")
            client.put_object(Bucket=f"cap-{i}", Key="blob", Body=b"x" * 1024)
        assert client.get_object(Bucket=f"cap-{buckets - 1}", Key="blob")["Body"].read() == (
            b"x" * 1024
        )
    finally:
        server.stop()
