"""NetworkPolicy enforcement on this host: nftables inside each pod's namespace.

Keeps the latest NetworkPolicies, Namespaces and pods the informers deliver,
asks the pure `netpolicy.ingress_plans` for every local pod's allow-list and
loads the rendered table into that pod's network namespace with
`ip netns exec <ns> nft -f -` (one atomic transaction per pod). A pod's
table is rewritten only when its text changes. A pod's own namespace is
registered (`attach`) before its containers start, so a selected pod never
runs a moment without its rules. A failed load is logged and retried on the
next change or resync: the informers relist every 30 s. Informer events
are applied by `run` in bursts (at most every 0.2 s); `attach` applies at once.
"""

import logging
import subprocess
import threading
from collections.abc import Mapping
from typing import Any

from cairn.devcluster.agent import netpolicy

log = logging.getLogger("cairn.devcluster.agent")
NFT_TIMEOUT_SECONDS = 10.0
COALESCE_SECONDS = 0.2


class NftError(RuntimeError):
    pass


def load(*, netns: str, script: str) -> None:
    """Load an nftables script into one network namespace (IO)."""
    argv = ["ip", "netns", "exec", netns, "nft", "-f", "-"]
    try:
        proc = subprocess.run(
            argv,
            input=script,
            capture_output=True,
            text=True,
            check=False,
            timeout=NFT_TIMEOUT_SECONDS,
        )
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        raise NftError(f"nft in {netns}: {exc} (needs nftables: apt-get install nftables)") from exc
    if proc.returncode != 0:
        raise NftError(f"nft in {netns} failed: {proc.stderr.strip()}")


class Enforcer:
    """The informers' handler for policies, namespaces and pods; applies per-pod tables."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._policies: dict[str, Mapping[str, Any]] = {}
        self._namespaces: dict[str, Mapping[str, Any]] = {}
        self._pods: dict[str, Mapping[str, Any]] = {}
        self._netns: dict[str, str] = {}  # pod key -> its netns, for pods this agent runs
        self._local_ip: dict[str, str] = {}  # pod key -> address, before its status says so
        self._applied: dict[str, str] = {}  # netns -> script last loaded
        self._dirty = threading.Event()

    def run(self, stop: threading.Event) -> None:
        """Apply informer events in bursts: a relist delivers every pod of the
        cluster, one recompute per burst instead of one per pod."""
        while not stop.is_set():
            if self._dirty.wait(1.0):
                self._dirty.clear()
                self.sync()
                stop.wait(COALESCE_SECONDS)

    @staticmethod
    def _store(table: dict[str, Mapping[str, Any]], event: str, obj: Mapping[str, Any]) -> None:
        key = netpolicy.pod_key(obj)
        if event == "DELETED":
            table.pop(key, None)
        else:
            table[key] = obj

    def on_policy(self, event: str, policy: dict[str, Any]) -> None:
        with self._lock:
            self._store(self._policies, event, policy)
        self._dirty.set()

    def on_namespace(self, event: str, namespace: dict[str, Any]) -> None:
        with self._lock:
            self._store(self._namespaces, event, namespace)
        self._dirty.set()

    def on_pod(self, event: str, pod: dict[str, Any]) -> None:
        with self._lock:
            self._store(self._pods, event, pod)
        self._dirty.set()

    def attach(self, *, pod: Mapping[str, Any], netns: str, address: str) -> None:
        """A local pod's namespace exists: enforce on it now, before its containers run."""
        key = netpolicy.pod_key(pod)
        with self._lock:
            self._pods.setdefault(key, pod)
            self._netns[key] = netns
            self._local_ip[key] = address
            self._applied.pop(netns, None)
        self.sync()

    def detach(self, *, pod: Mapping[str, Any], netns: str) -> None:
        """The namespace is going; a newer pod of the same name may own the key already."""
        key = netpolicy.pod_key(pod)
        with self._lock:
            self._applied.pop(netns, None)
            if self._netns.get(key) == netns:
                del self._netns[key]
                self._local_ip.pop(key, None)

    def _with_local_ip(self, key: str, pod: Mapping[str, Any]) -> Mapping[str, Any]:
        """A local pod is a peer as soon as it has an address, not when its status says so."""
        address = self._local_ip.get(key)
        status = pod.get("status") or {}
        if address is None or status.get("podIP"):
            return pod
        return {**pod, "status": {**status, "podIP": address}}

    def sync(self) -> None:
        """Recompute every local pod's table and load those that changed."""
        with self._lock:
            plans: dict[str, netpolicy.Plan] = {}
            if self._policies:  # none: every pod open, nothing to compute
                plans = netpolicy.ingress_plans(
                    policies=list(self._policies.values()),
                    pods=[self._with_local_ip(key, pod) for key, pod in self._pods.items()],
                    namespaces=list(self._namespaces.values()),
                    targets=list(self._netns),
                )
            work = []
            for key, netns in self._netns.items():
                script = netpolicy.nft_script(plans.get(key))
                if self._applied.get(netns) != script:
                    work.append((key, netns, script))
            for key, netns, script in work:
                try:
                    load(netns=netns, script=script)
                except NftError as exc:
                    log.warning("network policy not applied", extra={"pod": key, "error": str(exc)})
                    continue
                self._applied[netns] = script
                log.info("network policy applied", extra={"pod": key, "netns": netns})
