"""Is the status policy installed? One cached, deadlined answer for every reconcile.

IO. ``StatusPolicyCheck.missing`` reads the ValidatingAdmissionPolicy and its
binding (``core.statuspolicy``, cluster-scoped, by name) and says why they
cannot be relied on, or None when they can: absent, a binding that does not
``Deny`` with this policy, a policy whose match condition is not this
operator's (an older install that matched on the ServiceAccount name), or
unreadable (403, a timeout: the operator cannot tell, so it holds). Each read
has a deadline (``timeout_seconds``); it is made only for a plan that would
create the status Role, its binding or a pod (an attempt's start), and the
answer is cached for ``present_ttl_seconds`` (present) or
``missing_ttl_seconds`` (not), so any number of jobs cost at most one pair
of reads per interval: a deleted policy holds new pods within that interval,
a restored one lets held jobs start within seconds. ``core.policygate`` decides what a
missing policy holds back.
"""

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import urllib3
from kubernetes.client import exceptions as k8s_exceptions

from cairn.operator import kubeapi
from cairn.operator.core import statuspolicy

LOG = logging.getLogger(__name__)

_NAME = statuspolicy.POLICY_NAME
_POLICY = f"ValidatingAdmissionPolicy {_NAME}"
_BINDING = f"ValidatingAdmissionPolicyBinding {_NAME}"
_INSTALL = "install crds/cairn.dev_status-policy.yaml or the chart with crds.statusPolicy"


def _read(what: str, call: Callable[[], object]) -> tuple[object | None, str | None]:
    """(the object, None) or (None, why it is not usable)."""
    try:
        return call(), None
    except k8s_exceptions.ApiException as error:
        if error.status == 404:
            return None, f"{what} is not installed ({_INSTALL}): pods are held"
        LOG.warning("reading the %s: %s %s", what, error.status, error.reason)
        return None, f"could not read the {what} ({error.status} {error.reason}): pods are held"
    except (urllib3.exceptions.HTTPError, OSError) as error:
        LOG.warning("reading the %s: %r", what, error)
        return None, f"could not read the {what} (no answer in time): pods are held"


def _verdict(api: kubeapi.KubeApi, *, timeout: float) -> str | None:
    """Why the policy cannot be relied on (for status and Events), or None."""
    admission = api.admission
    policy, why = _read(
        _POLICY, lambda: admission.read_validating_admission_policy(_NAME, _request_timeout=timeout)
    )
    if why is not None:
        return why
    binding, why = _read(
        _BINDING,
        lambda: admission.read_validating_admission_policy_binding(_NAME, _request_timeout=timeout),
    )
    if why is not None:
        return why
    spec: Any = getattr(policy, "spec", None)
    conditions = [c.expression for c in getattr(spec, "match_conditions", None) or ()]
    if conditions != [statuspolicy.MATCH]:
        return f"{_POLICY} is not this operator's (reinstall it: {_INSTALL}): pods are held"
    bound: Any = getattr(binding, "spec", None)
    actions = getattr(bound, "validation_actions", None) or ()
    if getattr(bound, "policy_name", None) != _NAME or "Deny" not in actions:
        return f"{_BINDING} does not deny with {_NAME} ({_INSTALL}): pods are held"
    return None


@dataclasses.dataclass(kw_only=True)
class StatusPolicyCheck:
    """The cached verdict; thread-safe (reconciles call it from worker threads)."""

    present_ttl_seconds: float = 5.0
    missing_ttl_seconds: float = 5.0
    timeout_seconds: float = 5.0
    clock: Callable[[], float] = time.monotonic
    _verdict: str | None = dataclasses.field(default=None, init=False)
    _until: float = dataclasses.field(default=float("-inf"), init=False)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, init=False)

    def missing(self, api: kubeapi.KubeApi) -> str | None:
        """None when the policy and its binding are installed; else why not."""
        with self._lock:
            if self.clock() < self._until:
                return self._verdict
            verdict = _verdict(api, timeout=self.timeout_seconds)
            ttl = self.present_ttl_seconds if verdict is None else self.missing_ttl_seconds
            if verdict != self._verdict:
                LOG.log(
                    logging.INFO if verdict is None else logging.WARNING,
                    "status policy: %s",
                    verdict or "installed",
                )
            self._verdict, self._until = verdict, self.clock() + ttl
            return verdict


SHARED = StatusPolicyCheck()
"""The operator process's one check (``reconcile`` uses it unless given another)."""
