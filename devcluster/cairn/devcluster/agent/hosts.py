"""Pure: the hosts file every pod sees, standing in for cluster DNS.

A pod with `spec.hostname` and `spec.subdomain`, in a namespace with a
Service named like the subdomain, is resolvable as
`<hostname>.<subdomain>.<ns>.svc.cluster.local` (and the shorter forms), as
cluster DNS resolves headless-Service pod names. Addresses are published as
soon as a pod has one, as with `publishNotReadyAddresses: true`, which is
what rendezvous (torchrun, JobSet) needs. Every pod also resolves its own
hostname.
"""

import dataclasses

CLUSTER_DOMAIN = "cluster.local"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PodAddress:
    namespace: str
    name: str
    hostname: str
    subdomain: str | None
    ip: str


def pod_hostname(*, name: str, hostname: str | None) -> str:
    return (hostname or name)[:63]


def records(*, pods: list[PodAddress], services: set[tuple[str, str]]) -> list[str]:
    """Lines `<ip> <names…>` for every pod reachable through a headless Service."""
    lines = []
    for pod in sorted(pods, key=lambda p: (p.namespace, p.name)):
        if pod.subdomain and (pod.namespace, pod.subdomain) in services:
            base = f"{pod.hostname}.{pod.subdomain}"
            names = [
                f"{base}.{pod.namespace}.svc.{CLUSTER_DOMAIN}",
                f"{base}.{pod.namespace}.svc",
                f"{base}.{pod.namespace}",
            ]
            lines.append(f"{pod.ip} {' '.join(names)}")
    return lines


def hosts_file(*, own: PodAddress, cluster_records: list[str]) -> str:
    own_names = [own.hostname]
    if own.subdomain:
        own_names.insert(0, f"{own.hostname}.{own.subdomain}.{own.namespace}.svc.{CLUSTER_DOMAIN}")
    header = [
        "# Written by the devcluster node agent (cluster DNS stand-in).",
        "127.0.0.1 localhost",
        "::1 localhost ip6-localhost ip6-loopback",
        f"{own.ip} {' '.join(own_names)}",
    ]
    return "\n".join(header + cluster_records) + "\n"


def resolv_conf(namespace: str) -> str:
    return (
        f"search {namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}\n"
        "options ndots:1\n"
    )
