"""Fixtures the e2e modules share: a fresh namespace and S3 bucket per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from tests import demo


@pytest.fixture
def space(devcluster: Any, operator: Any) -> Iterator[tuple[str, str]]:
    """A fresh namespace and S3 bucket (with the credentials Secret); the namespace is deleted."""
    namespace = f"e2e-{uuid.uuid4().hex[:8]}"
    bucket = f"e2e-{uuid.uuid4().hex[:10]}"
    demo.prepare_namespace(
        api_client=devcluster.api_client,
        target=devcluster.target,
        namespace=namespace,
        bucket=bucket,
    )
    yield namespace, bucket
    try:
        client.CoreV1Api(devcluster.api_client).delete_namespace(namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise
