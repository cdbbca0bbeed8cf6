"""A namespace with the S3 Secret and a fresh bucket, for the prefix ownership tests (not tests).

`prepared` backs the `env` fixture of
`tests/integration/storage/test_prefix_ownership.py` and of the storage
cases of `tests/e2e/test_adversary.py`: jobs there upload to
``s3://<bucket>/shared/run`` unless a test names another URI.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from cairn.checkpoint import options
from tests.conftest import DevclusterHandle
from tests.integration.devcluster import kube_helpers as kh
from tests.integration.storage.test_storage_operator import (
    GROUP,
    PLURAL,
    SECRET,
    VERSION,
    WAIT,
    keys,
)

OWNER = ".cairn/owner.json"


class Env:
    """A namespace with the S3 Secret, a fresh bucket, and the calls these tests repeat."""

    def __init__(self, devcluster: DevclusterHandle, namespace: str, bucket: str) -> None:
        self.devcluster = devcluster
        self.namespace = namespace
        self.bucket = bucket
        self.custom = client.CustomObjectsApi(devcluster.api_client)
        creds = devcluster.s3_credentials
        self.opts = options.S3Options(
            uri=f"s3://{bucket}/shared/run",
            endpoint_url=devcluster.s3_endpoint,
            region="us-east-1",
            access_key=creds.access_key,
            secret_key=creds.secret_key,
        )
        self.s3: Any = devcluster.target.s3_client()

    def upload(self, **fields: Any) -> dict[str, Any]:
        return {
            "uri": self.opts.uri,
            "endpoint": self.devcluster.s3_pod_endpoint,
            "credentialsSecretRef": {"name": SECRET},
            **fields,
        }

    def create(self, body: dict[str, Any]) -> None:
        self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, body)

    def job(self, name: str) -> dict[str, Any]:
        job: dict[str, Any] = self.custom.get_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, name
        )
        return job

    def claim(self, name: str) -> dict[str, Any]:
        return dict(((self.job(name).get("status") or {}).get("storage") or {}).get("claim") or {})

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        found = [
            c for c in self.job(name).get("status", {}).get("conditions") or () if c["type"] == kind
        ]
        return dict(found[0]) if found else {}

    def wait_refused(self, name: str, reason: str) -> dict[str, Any]:
        found: dict[str, Any] = kh.wait_for(
            lambda: (
                (c := self.condition(name, "StorageRefused")).get("reason") == reason
                and c.get("status") == "True"
                and c
            ),
            timeout=WAIT,
            what=f"StorageRefused={reason} on {name}",
        )
        return found

    def events(self, name: str, reason: str) -> list[Any]:
        items = self.devcluster.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={name}"
        ).items
        return [e for e in items if e.reason == reason]

    def delete_and_wait(self, name: str, *, timeout: float = WAIT) -> None:
        self.custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)

        def gone() -> bool:
            try:
                self.job(name)
            except ApiException as exc:
                if exc.status == 404:
                    return True
                raise
            return False

        kh.wait_for(gone, timeout=timeout, what=f"{name} to be deleted")

    def owner(self) -> dict[str, Any]:
        body = self.s3.get_object(Bucket=self.bucket, Key=f"shared/run/{OWNER}")["Body"].read()
        return dict(json.loads(body))


@contextlib.contextmanager
def prepared(devcluster: DevclusterHandle) -> Iterator[Env]:
    """A fresh namespace (deleted after) with the S3 Secret, and a fresh bucket (emptied and
    deleted after); a test module's `env` fixture wraps it."""
    with contextlib.contextmanager(kh.temp_namespace)(
        devcluster.core, prefix="prefix"
    ) as namespace:
        bucket = f"claim-{uuid.uuid4().hex[:10]}"
        found = Env(devcluster, namespace, bucket)
        found.s3.create_bucket(Bucket=bucket)
        creds = devcluster.s3_credentials
        devcluster.core.create_namespaced_secret(
            namespace,
            kh.s3_secret(SECRET, access_key=creds.access_key, secret_key=creds.secret_key),
        )
        try:
            yield found
        finally:
            for key in keys(found.s3, bucket, ""):
                found.s3.delete_object(Bucket=bucket, Key=key)
            found.s3.delete_bucket(Bucket=bucket)
