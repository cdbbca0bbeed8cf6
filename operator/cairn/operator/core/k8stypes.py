"""Typed shapes of the Kubernetes payloads the operator builds.

Pure: TypedDicts for the subset of core/v1, rbac/v1 and networking/v1 objects that
``builders`` produces and ``jobapply`` sends, and ``Event``, the one type for
a Kubernetes Event the operator decides to post (the reconcile plan and the
S3 pass alike; ``jobapply.post_event`` sends it). Opaque user-supplied pieces
(affinity, volumes, tolerations) stay ``dict[str, Any]``: the API server
validates them against the core schemas when the pod is created.
"""

import dataclasses
from typing import Any, Literal, NotRequired, TypedDict

EventType = Literal["Normal", "Warning"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Event:
    """A Kubernetes Event on the TrainingJob."""

    type: EventType
    reason: str
    message: str


class OwnerReference(TypedDict):
    apiVersion: str
    kind: str
    name: str
    uid: str
    controller: bool
    blockOwnerDeletion: bool


class ObjectMeta(TypedDict):
    name: str
    namespace: str
    labels: dict[str, str]
    annotations: NotRequired[dict[str, str]]
    ownerReferences: list[OwnerReference]


class KeySelector(TypedDict):
    name: str
    key: str


class FieldSelector(TypedDict):
    fieldPath: str


class EnvVarSource(TypedDict, total=False):
    secretKeyRef: KeySelector
    fieldRef: FieldSelector


class EnvVar(TypedDict):
    name: str
    value: NotRequired[str]
    valueFrom: NotRequired[EnvVarSource | dict[str, Any]]


class VolumeMount(TypedDict):
    name: str
    mountPath: str
    subPath: NotRequired[str]
    readOnly: NotRequired[bool]


class ContainerPort(TypedDict):
    name: str
    containerPort: int
    protocol: Literal["TCP"]


class Container(TypedDict):
    name: str
    image: str
    command: NotRequired[list[str]]
    args: NotRequired[list[str]]
    env: list[EnvVar]
    ports: list[ContainerPort]
    resources: NotRequired[dict[str, dict[str, int | str]]]
    volumeMounts: list[VolumeMount | dict[str, Any]]
    securityContext: dict[str, Any]
    terminationMessagePath: str
    terminationMessagePolicy: Literal["File", "FallbackToLogsOnError"]
    envFrom: NotRequired[list[dict[str, Any]]]


class PodSpec(TypedDict):
    restartPolicy: Literal["Never"]
    hostname: str
    subdomain: str
    serviceAccountName: str
    automountServiceAccountToken: bool
    terminationGracePeriodSeconds: int
    securityContext: dict[str, Any]
    containers: list[Container]
    volumes: list[dict[str, Any]]
    nodeSelector: NotRequired[dict[str, str]]
    tolerations: NotRequired[list[dict[str, Any]]]
    affinity: NotRequired[dict[str, Any]]
    priorityClassName: NotRequired[str]
    schedulerName: NotRequired[str]
    imagePullSecrets: NotRequired[list[dict[str, str]]]
    topologySpreadConstraints: NotRequired[list[dict[str, Any]]]
    runtimeClassName: NotRequired[str]
    schedulingGates: NotRequired[list[dict[str, Any]]]
    initContainers: NotRequired[list[dict[str, Any]]]


class Pod(TypedDict):
    apiVersion: Literal["v1"]
    kind: Literal["Pod"]
    metadata: ObjectMeta
    spec: PodSpec


class ServicePort(TypedDict):
    name: str
    port: int
    targetPort: int
    protocol: Literal["TCP"]


class ServiceSpec(TypedDict):
    clusterIP: Literal["None"]
    publishNotReadyAddresses: bool
    selector: dict[str, str]
    ports: list[ServicePort]


class Service(TypedDict):
    apiVersion: Literal["v1"]
    kind: Literal["Service"]
    metadata: ObjectMeta
    spec: ServiceSpec


class ServiceAccount(TypedDict):
    apiVersion: Literal["v1"]
    kind: Literal["ServiceAccount"]
    metadata: ObjectMeta


class PolicyRule(TypedDict):
    apiGroups: list[str]
    resources: list[str]
    resourceNames: list[str]
    verbs: list[str]


class Role(TypedDict):
    apiVersion: Literal["rbac.authorization.k8s.io/v1"]
    kind: Literal["Role"]
    metadata: ObjectMeta
    rules: list[PolicyRule]


class RoleRef(TypedDict):
    apiGroup: Literal["rbac.authorization.k8s.io"]
    kind: Literal["Role"]
    name: str


class Subject(TypedDict):
    kind: Literal["ServiceAccount"]
    name: str
    namespace: str


class RoleBinding(TypedDict):
    apiVersion: Literal["rbac.authorization.k8s.io/v1"]
    kind: Literal["RoleBinding"]
    metadata: ObjectMeta
    roleRef: RoleRef
    subjects: list[Subject]


class Secret(TypedDict):
    """The job's manifest keyring, or a ray job's Ray token. ``data`` is absent
    from what ``plan`` returns: ``jobapply`` draws it when it creates the
    Secret, so no key is ever part of a Plan (which tests and logs print)."""

    apiVersion: Literal["v1"]
    kind: Literal["Secret"]
    metadata: ObjectMeta
    type: Literal["Opaque"]
    immutable: NotRequired[bool]
    data: NotRequired[dict[str, str]]


class LabelSelector(TypedDict):
    matchLabels: dict[str, str]


class NetworkPolicyPeer(TypedDict):
    podSelector: LabelSelector


class NetworkPolicyPort(TypedDict):
    protocol: Literal["TCP"]
    port: int


NetworkPolicyIngressRule = TypedDict(
    "NetworkPolicyIngressRule",
    {"from": NotRequired[list[NetworkPolicyPeer]], "ports": NotRequired[list[NetworkPolicyPort]]},
)
"""networking/v1 ingress rule (functional form: ``from`` is a Python keyword)."""


class NetworkPolicySpec(TypedDict):
    podSelector: LabelSelector
    policyTypes: list[Literal["Ingress"]]
    ingress: list[NetworkPolicyIngressRule]


class NetworkPolicy(TypedDict):
    """The job's network boundary (``builders.network_policy``, docs/security.md)."""

    apiVersion: Literal["networking.k8s.io/v1"]
    kind: Literal["NetworkPolicy"]
    metadata: ObjectMeta
    spec: NetworkPolicySpec


Child = Pod | Service | ServiceAccount | Role | RoleBinding | Secret | NetworkPolicy
"""Everything the operator creates for a job."""
ChildKind = Literal[
    "Pod", "Service", "ServiceAccount", "Role", "RoleBinding", "Secret", "NetworkPolicy"
]


class ConditionDict(TypedDict):
    """metav1.Condition on the wire."""

    type: str
    status: Literal["True", "False", "Unknown"]
    observedGeneration: int
    lastTransitionTime: str
    reason: str
    message: str


class LastFailureDict(TypedDict):
    attempt: int
    time: str
    reason: str
    message: str
    rank: NotRequired[int]
    exitCode: NotRequired[int]
    counted: bool
    backoffSeconds: NotRequired[int]


class ProgressDict(TypedDict):
    time: str
    step: NotRequired[int]


class RayStatusPatch(TypedDict, total=False):
    """The operator's keys of ``status.ray`` / ``status.torchrun`` (the rest is the runtime's)."""

    group: int
    announcedInPlaceRestarts: int


class StatusPatch(TypedDict, total=False):
    """The operator's JSON merge patch of /status: only operator-owned fields.

    ``None`` removes a field. ``step`` and ``checkpoints`` belong to the writer
    on rank 0 and never appear here.
    """

    phase: str
    observedGeneration: int
    attempt: int
    restarts: int
    restartsCountTowardsMax: int
    startTime: str | None
    attemptStartTime: str | None
    completionTime: str | None
    lastFailure: LastFailureDict | None
    progress: ProgressDict | None
    conditions: list[ConditionDict]
    ray: RayStatusPatch
    torchrun: RayStatusPatch
    resumeApplied: dict[str, Any]
    podReplacements: list[dict[str, Any]] | None
