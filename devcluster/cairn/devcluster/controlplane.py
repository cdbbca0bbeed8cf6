"""Command lines and kubeconfigs for etcd and the Kubernetes control plane.

Pure where it can be: each `*_command` function maps the state paths and
ports to an argv, and `kubeconfig` renders a client configuration; `cluster`
runs them. The flags are those of a plain kubeadm-style cluster: RBAC and
Node authorization, the default admission plugins, ServiceAccount token
issuance (TokenRequest) with a signing key, OwnerReferencesPermissionEnforcement
(as on OpenShift), the controller-manager's garbage
collector, namespace, ReplicaSet/Deployment and ServiceAccount controllers,
and the real scheduler.
"""

import dataclasses
import pathlib

import yaml

from cairn.devcluster import build, paths

SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
SERVICE_CIDR = "10.96.0.0/16"
POD_GATEWAY = "10.244.0.1"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Ports:
    """Loopback ports of the control plane (uncommon ones, to dodge real clusters)."""

    apiserver: int = 6443
    etcd_client: int = 12379
    etcd_peer: int = 12380
    s3: int = 18333
    kubelet_base: int = 10250

    @property
    def control_plane(self) -> tuple[int, ...]:
        return (self.apiserver, self.etcd_client, self.etcd_peer)


def etcd_command(*, state: paths.StatePaths, ports: Ports) -> list[str]:
    client = f"http://127.0.0.1:{ports.etcd_client}"
    peer = f"http://127.0.0.1:{ports.etcd_peer}"
    return [
        str(build.ETCD.binary("etcd")),
        "--name=devcluster",
        f"--data-dir={state.etcd_data}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=devcluster={peer}",
        "--listen-metrics-urls=",
        "--log-level=warn",
        # A laptop-sized database with compaction, so long test runs don't grow it.
        "--quota-backend-bytes=2147483648",
        "--auto-compaction-retention=5m",
        "--unsafe-no-fsync",
    ]


def apiserver_command(*, state: paths.StatePaths, ports: Ports) -> list[str]:
    pki = state.pki
    return [
        str(build.KUBERNETES.binary("kube-apiserver")),
        f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
        "--bind-address=0.0.0.0",
        f"--secure-port={ports.apiserver}",
        f"--advertise-address={POD_GATEWAY}",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
        "--authorization-mode=Node,RBAC",
        # On top of the defaults: as OpenShift does, a child may carry
        # blockOwnerDeletion only if its creator may update the owner's finalizers.
        "--enable-admission-plugins=OwnerReferencesPermissionEnforcement",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
        f"--kubelet-certificate-authority={pki / 'ca.crt'}",
        "--kubelet-preferred-address-types=InternalIP",
        "--allow-privileged=true",
        "--profiling=false",
        "--event-ttl=1h",
        "--endpoint-reconciler-type=lease",
        "--v=1",
    ]


def controller_manager_command(*, state: paths.StatePaths) -> list[str]:
    kubeconfig = state.kubeconfig("controller-manager")
    pki = state.pki
    return [
        str(build.KUBERNETES.binary("kube-controller-manager")),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        f"--root-ca-file={pki / 'ca.crt'}",
        f"--service-account-private-key-file={pki / 'sa.key'}",
        f"--cluster-signing-cert-file={pki / 'ca.crt'}",
        f"--cluster-signing-key-file={pki / 'ca.key'}",
        "--use-service-account-credentials=true",
        "--controllers=*,bootstrapsigner,tokencleaner",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--leader-elect=false",
        "--secure-port=0",
        "--v=1",
    ]


def scheduler_command(*, state: paths.StatePaths) -> list[str]:
    kubeconfig = state.kubeconfig("scheduler")
    return [
        str(build.KUBERNETES.binary("kube-scheduler")),
        f"--kubeconfig={kubeconfig}",
        f"--authentication-kubeconfig={kubeconfig}",
        f"--authorization-kubeconfig={kubeconfig}",
        "--leader-elect=false",
        "--secure-port=0",
        "--v=1",
    ]


def kubeconfig(*, server: str, pki: pathlib.Path, client_stem: str, user: str) -> str:
    """Pure: a kubeconfig for one client certificate of the devcluster."""
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "devcluster",
                "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate": str(pki / f"{client_stem}.crt"),
                    "client-key": str(pki / f"{client_stem}.key"),
                },
            }
        ],
        "contexts": [{"name": "devcluster", "context": {"cluster": "devcluster", "user": user}}],
        "current-context": "devcluster",
    }
    return yaml.safe_dump(doc, sort_keys=False)
