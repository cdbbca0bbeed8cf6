"""The Kubernetes API as the operator calls it: the ``api`` every IO module takes.

IO (the lowest IO layer: it imports only the Kubernetes client). One
``KubeApi`` is built in ``handlers.configure`` over the reconcile
``ApiClient`` and kept on ``runtime.Runtime``; the loops and IO modules
(``reconcile``, ``jobapply``, ``kueueapply``, ``s3observe``, ``s3apply``,
``s3pass``, ``finishedjobs``, ``ondelete``) reach the API server only
through it. The pod reflector (``podcache``) and the leader election
(``leader``) hold their own ``ApiClient`` and are not part of it.

The Python client is untyped, so the types live here: each protocol lists
exactly the calls the operator makes on one API group, with typed
arguments, and mypy checks every call site against it. Custom objects come
back as ``dict[str, Any]`` (the client returns the decoded JSON); a call
with ``_preload_content=False`` returns the undecoded ``RawResponse``;
built-in kinds read without it come back as the client's model objects
(``Model``: ``V1Secret``, ``V1Pod``..., untyped).
"""

import dataclasses
from typing import Any, Literal, Protocol, TypeAlias

from kubernetes import client

Model: TypeAlias = Any
"""A ``kubernetes.client`` model object (``V1Secret``, ``V1Pod``, ``V1Role``...)."""

Body: TypeAlias = dict[str, Any]
"""A request body as JSON (the operator's builders produce these)."""


class BoundedApiClient(client.ApiClient):  # type: ignore[misc]
    """An ``ApiClient`` whose every call has a deadline: a call that names no
    ``_request_timeout`` gets ``(connect, read)`` seconds. The client's own
    default is none at all, so a frozen API server or a half-open connection
    would hold the calling thread until the connection dies."""

    def __init__(
        self, configuration: client.Configuration, *, connect_seconds: float, read_seconds: float
    ) -> None:
        super().__init__(configuration)
        self._default_timeout = (connect_seconds, read_seconds)

    def call_api(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("_request_timeout") is None:
            kwargs["_request_timeout"] = self._default_timeout
        return super().call_api(*args, **kwargs)


class RawResponse(Protocol):
    """An undecoded answer (urllib3's response): the JSON bytes, and the
    connection to hand back when the body is not needed."""

    @property
    def data(self) -> bytes: ...

    def drain_conn(self) -> None: ...

    def release_conn(self) -> None: ...


class CoreCalls(Protocol):
    """The core/v1 calls: pods, Services, ServiceAccounts, Secrets, Events."""

    def list_namespaced_pod(
        self, namespace: str, *, label_selector: str, _preload_content: Literal[False]
    ) -> RawResponse: ...

    def create_namespaced_pod(
        self, namespace: str, body: Body, *, field_manager: str, _preload_content: Literal[False]
    ) -> RawResponse: ...

    def read_namespaced_pod(self, name: str, namespace: str) -> Model: ...

    def delete_namespaced_pod(
        self, name: str, namespace: str, *, body: Model, _preload_content: bool = True
    ) -> Any: ...

    def create_namespaced_service(
        self, namespace: str, body: Body, *, field_manager: str, _preload_content: Literal[False]
    ) -> RawResponse: ...

    def read_namespaced_service(self, name: str, namespace: str) -> Model: ...

    def delete_namespaced_service(
        self, name: str, namespace: str, *, body: Model, _preload_content: Literal[False]
    ) -> RawResponse: ...

    def create_namespaced_service_account(
        self, namespace: str, body: Body, *, field_manager: str, _preload_content: Literal[False]
    ) -> RawResponse: ...

    def read_namespaced_service_account(self, name: str, namespace: str) -> Model: ...

    def delete_namespaced_service_account(
        self, name: str, namespace: str, *, body: Model, _preload_content: Literal[False]
    ) -> RawResponse: ...

    def create_namespaced_secret(
        self, namespace: str, body: Body, *, field_manager: str, _preload_content: Literal[False]
    ) -> RawResponse: ...

    def read_namespaced_secret(self, name: str, namespace: str) -> Model: ...

    def create_namespaced_event(
        self, namespace: str, body: Body, *, _preload_content: Literal[False]
    ) -> RawResponse: ...


class RbacCalls(Protocol):
    """The rbac.authorization.k8s.io/v1 calls: the job's Role and RoleBinding."""

    def create_namespaced_role(
        self, namespace: str, body: Body, *, field_manager: str, _preload_content: Literal[False]
    ) -> RawResponse: ...

    def read_namespaced_role(self, name: str, namespace: str) -> Model: ...

    def create_namespaced_role_binding(
        self, namespace: str, body: Body, *, field_manager: str, _preload_content: Literal[False]
    ) -> RawResponse: ...

    def read_namespaced_role_binding(self, name: str, namespace: str) -> Model: ...


class AdmissionCalls(Protocol):
    """The admissionregistration.k8s.io/v1 reads: the status policy and its binding
    (``policycheck``), each with a per-request deadline."""

    def read_validating_admission_policy(self, name: str, *, _request_timeout: float) -> Model: ...

    def read_validating_admission_policy_binding(
        self, name: str, *, _request_timeout: float
    ) -> Model: ...


class NetworkingCalls(Protocol):
    """The networking.k8s.io/v1 calls: the job's NetworkPolicy (``jobapply``;
    the API server's garbage collector deletes it with the job)."""

    def create_namespaced_network_policy(
        self, namespace: str, body: Body, *, field_manager: str, _preload_content: Literal[False]
    ) -> RawResponse: ...

    def read_namespaced_network_policy(self, name: str, namespace: str) -> Model: ...


class CustomObjectCalls(Protocol):
    """Custom objects: TrainingJobs (status, TTL delete) and Kueue's Workloads,
    ResourceFlavors and WorkloadPriorityClasses."""

    def get_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, name: str
    ) -> dict[str, Any]: ...

    def get_cluster_custom_object(
        self, group: str, version: str, plural: str, name: str
    ) -> dict[str, Any]: ...

    def create_namespaced_custom_object(
        self,
        group: str,
        version: str,
        namespace: str,
        plural: str,
        body: Body,
        *,
        field_manager: str,
    ) -> dict[str, Any]: ...

    # The client's own positional signature (six positionals).
    def patch_namespaced_custom_object(  # noqa: PLR0917
        self,
        group: str,
        version: str,
        namespace: str,
        plural: str,
        name: str,
        body: Body,
        *,
        field_manager: str,
        _content_type: str,
    ) -> dict[str, Any]: ...

    def patch_namespaced_custom_object_status(  # noqa: PLR0917
        self,
        group: str,
        version: str,
        namespace: str,
        plural: str,
        name: str,
        body: Body,
        *,
        field_manager: str,
        _content_type: str,
    ) -> dict[str, Any]: ...

    def delete_namespaced_custom_object(
        self,
        group: str,
        version: str,
        namespace: str,
        plural: str,
        name: str,
        *,
        propagation_policy: str,
    ) -> dict[str, Any]: ...


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class KubeApi:
    """The API groups the operator calls, each typed by the calls it makes."""

    core: CoreCalls
    rbac: RbacCalls
    custom: CustomObjectCalls
    admission: AdmissionCalls
    networking: NetworkingCalls

    @classmethod
    def of(cls, api_client: client.ApiClient) -> "KubeApi":
        """The groups over one ``ApiClient`` (its connection pool is shared)."""
        return cls(
            core=client.CoreV1Api(api_client),
            rbac=client.RbacAuthorizationV1Api(api_client),
            custom=client.CustomObjectsApi(api_client),
            admission=client.AdmissionregistrationV1Api(api_client),
            networking=client.NetworkingV1Api(api_client),
        )
