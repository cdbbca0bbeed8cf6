"""The devcluster's control plane behaves as a plain Kubernetes cluster does.

Covers, against the real kube-apiserver / controller-manager / etcd:
- a CRD with a structural schema rejects an invalid object with the API
  server's own message;
- owner-reference garbage collection deletes a child;
- RBAC with a ServiceAccount token from the TokenRequest API: a verb the
  Role grants is allowed, one it lacks gets 403;
- the S3 server round-trips a multipart upload with a CRC32C checksum;
- `up` on a running cluster is a no-op, and a failed `up`/`down` for another
  state dir leaves the running cluster's host-wide bridge and S3 sockets alone.
"""

import dataclasses
import json
import pathlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from cairn.devcluster import cluster, errors, network, paths, s3

pytestmark = pytest.mark.cluster


@pytest.fixture
def namespace(devcluster: Any) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    devcluster.core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    yield name
    devcluster.core.delete_namespace(name)


def _wait_for(predicate: Any, *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_up_on_running_cluster_is_noop(devcluster: Any) -> None:
    devcluster.require_devcluster()
    assert cluster.up(devcluster.target).already_running


def test_other_state_dir_never_touches_the_running_cluster(
    devcluster: Any, tmp_path: pathlib.Path
) -> None:
    devcluster.require_devcluster()
    state = tmp_path / "state"
    state.mkdir()
    (state / "cluster.json").write_text(json.dumps({"kubernetes": "v1.20.0"}))
    other = dataclasses.replace(devcluster.target, state=paths.StatePaths(root=state))
    with pytest.raises(errors.DevclusterError, match="down --purge"):
        cluster.up(other)
    cluster.down(other)
    assert network._link_exists(network.BRIDGE)
    assert all(sock.exists() for sock in s3.stray_sockets(devcluster.target.s3_ports))
    assert cluster.up(devcluster.target).already_running


def test_structural_crd_rejects_invalid_object(devcluster: Any, namespace: str) -> None:
    ext = client.ApiextensionsV1Api(devcluster.api_client)
    group = f"g{uuid.uuid4().hex[:6]}.example.com"
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "properties": {
                                        "size": {"type": "integer", "minimum": 1, "maximum": 10}
                                    },
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    ext.create_custom_resource_definition(crd)
    try:
        custom = client.CustomObjectsApi(devcluster.api_client)

        def established() -> bool:
            got = ext.read_custom_resource_definition(f"widgets.{group}")
            conditions = got.status.conditions or []
            return any(c.type == "Established" and c.status == "True" for c in conditions)

        _wait_for(established, timeout=30, what="the CRD to be established")
        body = {"apiVersion": f"{group}/v1", "kind": "Widget", "metadata": {"name": "w"}}
        with pytest.raises(ApiException) as rejected:
            custom.create_namespaced_custom_object(
                group, "v1", namespace, "widgets", {**body, "spec": {"size": 99}}
            )
        assert rejected.value.status == 422
        assert "spec.size" in rejected.value.body
        assert "should be less than or equal to 10" in rejected.value.body
        created = custom.create_namespaced_custom_object(
            group, "v1", namespace, "widgets", {**body, "spec": {"size": 3}}
        )
        assert created["spec"]["size"] == 3
    finally:
        ext.delete_custom_resource_definition(f"widgets.{group}")


def test_owner_reference_garbage_collection(devcluster: Any, namespace: str) -> None:
    core = devcluster.core
    owner = core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="owner"))
    )
    ref = client.V1OwnerReference(
        api_version="v1", kind="ConfigMap", name="owner", uid=owner.metadata.uid
    )
    core.create_namespaced_config_map(
        namespace,
        client.V1ConfigMap(metadata=client.V1ObjectMeta(name="child", owner_references=[ref])),
    )
    core.delete_namespaced_config_map("owner", namespace)

    def child_gone() -> bool:
        try:
            core.read_namespaced_config_map("child", namespace)
        except ApiException as exc:
            return bool(exc.status == 404)
        return False

    _wait_for(child_gone, timeout=60, what="the garbage collector to delete the child")


def test_rbac_with_token_request(devcluster: Any, namespace: str) -> None:
    devcluster.require_devcluster()
    core = devcluster.core
    rbac = client.RbacAuthorizationV1Api(devcluster.api_client)
    core.create_namespaced_service_account(
        namespace, client.V1ServiceAccount(metadata=client.V1ObjectMeta(name="reader"))
    )
    rbac.create_namespaced_role(
        namespace,
        client.V1Role(
            metadata=client.V1ObjectMeta(name="read-configmaps"),
            rules=[
                client.V1PolicyRule(
                    api_groups=[""], resources=["configmaps"], verbs=["get", "list"]
                )
            ],
        ),
    )
    rbac.create_namespaced_role_binding(
        namespace,
        client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name="reader"),
            role_ref=client.V1RoleRef(
                api_group="rbac.authorization.k8s.io", kind="Role", name="read-configmaps"
            ),
            subjects=[
                client.RbacV1Subject(kind="ServiceAccount", name="reader", namespace=namespace)
            ],
        ),
    )
    core.create_namespaced_config_map(
        namespace, client.V1ConfigMap(metadata=client.V1ObjectMeta(name="data"))
    )
    token = core.create_namespaced_service_account_token(
        "reader",
        namespace,
        client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=600)
        ),
    ).status.token

    configuration = client.Configuration()
    configuration.host = devcluster.target.server
    configuration.ssl_ca_cert = str(devcluster.target.state.pki / "ca.crt")
    configuration.api_key = {"authorization": f"Bearer {token}"}
    with client.ApiClient(configuration) as as_reader:
        reader = client.CoreV1Api(as_reader)
        assert reader.read_namespaced_config_map("data", namespace).metadata.name == "data"
        with pytest.raises(ApiException) as denied:
            reader.delete_namespaced_config_map("data", namespace)
        assert denied.value.status == 403
        with pytest.raises(ApiException) as denied_secrets:
            reader.list_namespaced_secret(namespace)
        assert denied_secrets.value.status == 403


def test_s3_multipart_upload_with_crc32c(devcluster: Any) -> None:
    devcluster.require_devcluster()
    s3 = devcluster.target.s3_client()
    bucket = f"multipart-{uuid.uuid4().hex[:10]}"
    s3.create_bucket(Bucket=bucket)
    part = 5 * 1024 * 1024
    payload = bytes(range(256)) * (part * 2 // 256 + 1000)
    upload = s3.create_multipart_upload(Bucket=bucket, Key="blob", ChecksumAlgorithm="CRC32C")
    parts: list[Any] = []
    for number, offset in enumerate(range(0, len(payload), part), start=1):
        got = s3.upload_part(
            Bucket=bucket,
            Key="blob",
            UploadId=upload["UploadId"],
            PartNumber=number,
            Body=payload[offset : offset + part],
            ChecksumAlgorithm="CRC32C",
        )
        parts.append(
            {"PartNumber": number, "ETag": got["ETag"], "ChecksumCRC32C": got["ChecksumCRC32C"]}
        )
    s3.complete_multipart_upload(
        Bucket=bucket, Key="blob", UploadId=upload["UploadId"], MultipartUpload={"Parts": parts}
    )
    assert len(parts) == 3
    body = s3.get_object(Bucket=bucket, Key="blob")["Body"].read()
    assert body == payload
    head = s3.head_object(Bucket=bucket, Key="blob", ChecksumMode="ENABLED")
    assert head.get("ChecksumCRC32C"), head
