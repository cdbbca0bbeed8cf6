"""The node agent's process: wiring of nodes, informers, pod workers, logs.

`python -m cairn.devcluster.agent --state-dir D --kubeconfig K --node SPEC…`
registers the nodes, then dispatches every pod bound to one of them to a
`runtime.PodWorker`, keeps all pods' hosts files current as pods and
headless Services change, runs the local-path provisioner and one log
server per node. SIGTERM stops every pod process it started and removes the
network namespaces. Logs are JSON lines on stderr.
"""

import argparse
import json
import logging
import pathlib
import signal
import sys
import threading
import time
from typing import Any

from kubernetes import client, config

from cairn.devcluster import network
from cairn.devcluster.agent import (
    hosts,
    informer,
    logserver,
    netfilter,
    nodes,
    provisioner,
    runtime,
)

log = logging.getLogger("cairn.devcluster.agent")
_STANDARD = set(vars(logging.makeLogRecord({})))
# The cluster sends SIGKILL 15 s after SIGTERM: stay well inside that.
SHUTDOWN_JOIN_SECONDS = 2.0
SHUTDOWN_GRACE_SECONDS = 5.0
POLICY_SYNC_SECONDS = 30.0
"""Deadline for the first list of NetworkPolicies and Namespaces before pods start."""


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)),
            "level": record.levelname.lower(),
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class Agent:
    def __init__(self, *, args: argparse.Namespace) -> None:
        self.state_dir = pathlib.Path(args.state_dir)
        self.api_client = config.new_client_from_config(config_file=args.kubeconfig)
        self.core = client.CoreV1Api(self.api_client)
        self.node_specs = [
            nodes.parse_node(text, kubelet_port=args.kubelet_port_base + i)
            for i, text in enumerate(args.node)
        ]
        self.node_names = {n.name for n in self.node_specs}
        self.stop = threading.Event()
        self.lock = threading.RLock()
        self.workers: dict[str, runtime.PodWorker] = {}
        self.services: set[tuple[str, str]] = set()
        self.used_indices: set[int] = set()
        self.enforcer = netfilter.Enforcer()
        self.ctx = runtime.Context(
            core=self.core,
            state_dir=self.state_dir,
            backoff_base_seconds=args.restart_backoff_seconds,
            allocate_index=self._allocate,
            release_index=self._release,
            hosts_changed=self._hosts_changed,
            hosts_records=self._records,
            stopping=self.stop,
            network_attached=lambda pod, netns, address: self.enforcer.attach(
                pod=pod, netns=netns, address=address
            ),
            network_detached=lambda pod, netns: self.enforcer.detach(pod=pod, netns=netns),
        )
        self.keeper = nodes.NodeKeeper(
            core=self.core,
            coordination=client.CoordinationV1Api(self.api_client),
            nodes=self.node_specs,
        )
        self.provisioner = provisioner.Provisioner(
            core=self.core,
            storage=client.StorageV1Api(self.api_client),
            root=self.state_dir / "volumes",
        )

    # --- addresses and hosts files
    def _allocate(self) -> int:
        with self.lock:
            index = next(
                i
                for i in range(1, 60000)
                if i not in self.used_indices and not network.netns_exists(i)
            )
            self.used_indices.add(index)
            return index

    def _release(self, index: int) -> None:
        with self.lock:
            self.used_indices.discard(index)

    def _records(self) -> list[str]:
        with self.lock:
            addresses = [w.address for w in self.workers.values() if w.address is not None]
            return hosts.records(pods=addresses, services=set(self.services))

    def _hosts_changed(self) -> None:
        records = self._records()
        with self.lock:
            workers = list(self.workers.values())
        for worker in workers:
            worker.write_hosts(records)

    # --- event handlers
    def on_pod(self, event: str, pod: dict[str, Any]) -> None:
        self.enforcer.on_pod(event, pod)  # every pod: any may be a policy's peer
        if pod["spec"].get("nodeName") not in self.node_names:
            return
        uid = pod["metadata"]["uid"]
        with self.lock:
            worker = self.workers.get(uid)
            if event == "DELETED":
                if worker is not None:
                    worker.forget()
                return
            if worker is not None:
                worker.update(pod)
                return
            phase = (pod.get("status") or {}).get("phase")
            if phase in ("Succeeded", "Failed"):
                if pod["metadata"].get("deletionTimestamp"):
                    runtime.PodWorker(pod=pod, ctx=self.ctx)._finish_deletion()
                return
            worker = runtime.PodWorker(pod=pod, ctx=self.ctx)
            self.workers[uid] = worker
        worker.start()

    def on_service(self, event: str, service: dict[str, Any]) -> None:
        key = (service["metadata"]["namespace"], service["metadata"]["name"])
        headless = (service.get("spec") or {}).get("clusterIP") == "None"
        with self.lock:
            before = set(self.services)
            if event == "DELETED" or not headless:
                self.services.discard(key)
            else:
                self.services.add(key)
            changed = before != self.services
        if changed:
            self._hosts_changed()

    def _reap_workers(self) -> None:
        with self.lock:
            for uid in [u for u, w in self.workers.items() if w.finished]:
                del self.workers[uid]

    # --- logs
    def _pod_dir(self, namespace: str, name: str) -> pathlib.Path | None:
        with self.lock:
            for worker in self.workers.values():
                if worker.namespace == namespace and worker.name == name:
                    return worker.dir
        matches = sorted((self.state_dir / "pods").glob(f"{namespace}_{name}_*"))
        return matches[-1] if matches else None

    def _running(self, namespace: str, name: str, container: str) -> bool:
        with self.lock:
            return any(
                w.namespace == namespace
                and w.name == name
                and not w.finished
                and w.container_running(container)
                for w in self.workers.values()
            )

    # --- lifecycle
    def _stop_pods(self) -> None:
        """SIGTERM every pod process, SIGKILL what outlives the grace, drop the netns.

        Workers see `stop` and leave their loops first, so nothing restarts
        what is being stopped. The bridge stays: `cluster down` removes it.
        """
        with self.lock:
            workers = list(self.workers.values())
        deadline = time.monotonic() + SHUTDOWN_JOIN_SECONDS
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        for worker in workers:
            worker.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + SHUTDOWN_GRACE_SECONDS
        while time.monotonic() < deadline and any(w.live_processes() for w in workers):
            time.sleep(0.1)
        for worker in workers:
            worker.signal_all(signal.SIGKILL)
            worker.release_network()
        log.info("pods stopped", extra={"pods": len(workers)})

    def run(self) -> int:
        network.ensure_bridge()
        self.keeper.register()
        provisioner.ensure_storage_class(client.StorageV1Api(self.api_client))
        servers = []
        for spec in self.node_specs:
            server = logserver.make_server(
                port=spec.kubelet_port,
                pki=self.state_dir / "pki",
                lookup=self._pod_dir,
                running=self._running,
            )
            logserver.serve_in_background(server)
            servers.append(server)
        threading.Thread(target=self.keeper.run, name="node-keeper", daemon=True).start()
        threading.Thread(
            target=self.enforcer.run, args=(self.stop,), name="netpolicy", daemon=True
        ).start()
        informers = [
            informer.Informer(
                name="services",
                api_client=self.api_client,
                list_fn=self.core.list_service_for_all_namespaces,
                handler=self.on_service,
                stop=self.stop,
            ),
            informer.Informer(
                name="pvcs",
                api_client=self.api_client,
                list_fn=self.core.list_persistent_volume_claim_for_all_namespaces,
                handler=self.provisioner.on_claim,
                stop=self.stop,
            ),
            informer.Informer(
                name="pvs",
                api_client=self.api_client,
                list_fn=self.core.list_persistent_volume,
                handler=self.provisioner.on_volume,
                stop=self.stop,
            ),
            informer.Informer(
                name="networkpolicies",
                api_client=self.api_client,
                list_fn=client.NetworkingV1Api(
                    self.api_client
                ).list_network_policy_for_all_namespaces,
                handler=self.enforcer.on_policy,
                stop=self.stop,
            ),
            informer.Informer(
                name="namespaces",
                api_client=self.api_client,
                list_fn=self.core.list_namespace,
                handler=self.enforcer.on_namespace,
                stop=self.stop,
            ),
            informer.Informer(
                name="pods",
                api_client=self.api_client,
                list_fn=self.core.list_pod_for_all_namespaces,
                handler=self.on_pod,
                stop=self.stop,
            ),
        ]
        for inf in informers[:-1]:
            inf.start()
        for inf in informers[-3:-1]:  # policies known before any pod starts
            if not inf.synced.wait(POLICY_SYNC_SECONDS):
                log.warning("informer not synced", extra={"informer": inf.name})
        informers[-1].start()
        log.info("agent ready", extra={"nodes": sorted(self.node_names)})
        while not self.stop.wait(1.0):
            self._reap_workers()
        log.info("agent stopping")
        self.keeper.stop.set()
        for server in servers:
            server.shutdown()
        self._stop_pods()
        log.info("agent stopped")
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cairn.devcluster.agent", description=__doc__)
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--node", action="append", required=True, help="NAME:cpu=4,memory=16Gi,…")
    parser.add_argument("--kubelet-port-base", type=int, default=10250)
    parser.add_argument(
        "--restart-backoff-seconds",
        type=float,
        default=10.0,
        help="first container restart back-off (the kubelet's is 10 s), doubling to 300 s",
    )
    args = parser.parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    agent = Agent(args=args)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop.set())
    signal.signal(signal.SIGINT, lambda *_: agent.stop.set())
    return agent.run()
