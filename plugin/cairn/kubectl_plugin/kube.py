"""The plugin's only I/O with the API server: config, the job, its pods, logs.

Honours ``--kubeconfig``, ``--context`` and ``-n/--namespace`` like kubectl,
defaulting to the kubeconfig's current context and its namespace.
"""

import contextlib
import dataclasses
import json
from collections.abc import Iterator
from typing import Any

from kubernetes import client, config
from kubernetes.client import exceptions as k8s_exceptions

from cairn.api import trainingjob
from cairn.kubectl_plugin import views

MERGE_PATCH = "application/merge-patch+json"
CONTAINER = "trainer"


class PluginError(Exception):
    """A failure to report in one line (exit code 1)."""


class ConflictError(PluginError):
    """The object changed since it was read (HTTP 409 on a resourceVersion precondition)."""


@dataclasses.dataclass(kw_only=True, slots=True)
class Kube:
    api: client.ApiClient
    namespace: str

    @classmethod
    def connect(
        cls, *, kubeconfig: str | None, context: str | None, namespace: str | None
    ) -> "Kube":
        try:
            _, active = config.list_kube_config_contexts(config_file=kubeconfig)
            if context is not None:
                contexts, _ = config.list_kube_config_contexts(config_file=kubeconfig)
                active = next((c for c in contexts if c["name"] == context), None)
                if active is None:
                    raise PluginError(f"context {context!r} not found in the kubeconfig")
            api = config.new_client_from_config(config_file=kubeconfig, context=context)
        except config.ConfigException as error:
            raise PluginError(f"cannot load the kubeconfig: {error}") from error
        default_ns = (active or {}).get("context", {}).get("namespace") or "default"
        return cls(api=api, namespace=namespace or default_ns)

    def close(self) -> None:
        self.api.close()

    def _custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)

    def get_job(self, name: str) -> dict[str, Any]:
        try:
            job: dict[str, Any] = self._custom().get_namespaced_custom_object(
                trainingjob.GROUP, trainingjob.VERSION, self.namespace, trainingjob.PLURAL, name
            )
        except k8s_exceptions.ApiException as error:
            if error.status == 404:
                raise PluginError(
                    f'trainingjob "{name}" not found in namespace "{self.namespace}"'
                ) from error
            raise PluginError(f"reading trainingjob {name}: {error.reason}") from error
        return job

    def patch_job(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        """A JSON merge patch of the spec with the plugin's own field manager."""
        try:
            job: dict[str, Any] = self._custom().patch_namespaced_custom_object(
                trainingjob.GROUP,
                trainingjob.VERSION,
                self.namespace,
                trainingjob.PLURAL,
                name,
                patch,
                field_manager=views.FIELD_MANAGER,
                _content_type=MERGE_PATCH,
            )
        except k8s_exceptions.ApiException as error:
            detail = error.body if isinstance(error.body, str) else error.reason
            with contextlib.suppress(TypeError, ValueError, AttributeError):
                detail = json.loads(error.body).get("message", detail)
            kind = ConflictError if error.status == 409 else PluginError
            raise kind(f"patching trainingjob {name}: {detail}") from error
        return job

    def list_pods(self, selector: str) -> list[dict[str, Any]]:
        response = client.CoreV1Api(self.api).list_namespaced_pod(
            self.namespace, label_selector=selector, _preload_content=False
        )
        items: list[dict[str, Any]] = json.loads(response.data)["items"]
        return sorted(
            items,
            key=lambda p: (
                int(p["metadata"].get("labels", {}).get("cairn.dev/attempt", 0)),
                int(p["metadata"].get("labels", {}).get("cairn.dev/rank", 0)),
            ),
        )

    def log_lines(self, pod: str, *, follow: bool, tail: int | None) -> Iterator[str]:
        """The trainer container's log, line by line (streamed with ``follow``)."""
        try:
            response = client.CoreV1Api(self.api).read_namespaced_pod_log(
                pod,
                self.namespace,
                container=CONTAINER,
                follow=follow,
                tail_lines=tail,
                _preload_content=False,
            )
        except k8s_exceptions.ApiException as error:
            raise PluginError(f"logs of pod {pod}: {error.reason}") from error
        try:
            pending = b""
            for chunk in response.stream(4096):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    yield line.decode(errors="replace")
            if pending:
                yield pending.decode(errors="replace")
        finally:
            response.release_conn()
