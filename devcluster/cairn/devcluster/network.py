"""Pod networking for the devcluster: a bridge and one network namespace per pod.

Each pod gets its own network namespace (`ip netns`), a veth pair into the
bridge `cairn0` (10.244.0.1/16, the pods' gateway, where the apiserver and
S3 are reachable) and an address from 10.244.1.0 upward. So two pods can both
listen on port 29500, and pods reach each other by address. Names resolve
through `/etc/netns/<ns>/hosts`, which `ip netns exec` bind-mounts over
`/etc/hosts`; it is rewritten in place so the bind mount sees each update.
Nothing is routed or masqueraded beyond the bridge.

Every namespace and veth the devcluster creates carries the `cairn-` prefix,
so `remove_all` removes exactly what it made. These are host-wide: the
cluster calls `remove_all` only for the state dir that claimed them.
"""

import ipaddress
import pathlib
import subprocess

from cairn.devcluster import errors

BRIDGE = "cairn0"
GATEWAY = "10.244.0.1"
PREFIX_LENGTH = 16
POD_RANGE_START = ipaddress.IPv4Address("10.244.1.2")
NETNS_PREFIX = "cairn-"
ETC_NETNS = pathlib.Path("/etc/netns")
NETNS_RUN_DIR = pathlib.Path("/run/netns")  # where `ip netns add` mounts the namespaces


def _ip(
    *args: str, netns: str | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    argv = ["ip", *(("-n", netns) if netns else ()), *args]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise errors.DevclusterError(
            "`ip` (iproute2) is missing: apt-get install iproute2"
        ) from exc
    if check and proc.returncode != 0:
        raise errors.DevclusterError(
            f"`{' '.join(argv)}` failed: {proc.stderr.strip()} (pod networking needs root)"
        )
    return proc


def _link_exists(name: str) -> bool:
    return _ip("link", "show", name, check=False).returncode == 0


BRIDGE_MAC = "02:ca:12:00:00:01"
"""Fixed (locally administered): a bridge without one takes the lowest MAC of
its ports, so deleting a pod could change the gateway's MAC under every other
pod's ARP cache; measured: a pod lost the API server for ~20 s after another
pod on the node was force-deleted."""


def ensure_bridge() -> None:
    """Create the pods' bridge with the gateway address, if not there yet."""
    if not _link_exists(BRIDGE):
        _ip("link", "add", BRIDGE, "address", BRIDGE_MAC, "type", "bridge")
    addrs = _ip("-4", "addr", "show", "dev", BRIDGE).stdout
    if f"{GATEWAY}/{PREFIX_LENGTH}" not in addrs:
        _ip("addr", "add", f"{GATEWAY}/{PREFIX_LENGTH}", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")


def netns_name(index: int) -> str:
    return f"{NETNS_PREFIX}{index}"


def netns_exists(index: int) -> bool:
    """Whether namespace `cairn-<index>` is there (another agent's, or a leftover)."""
    return (NETNS_RUN_DIR / netns_name(index)).exists()


def pod_address(index: int) -> str:
    """Pure: the address of the pod namespace with this index."""
    return str(POD_RANGE_START + index)


def create_pod_netns(*, index: int, hostname: str) -> tuple[str, str]:
    """Create namespace `cairn-<index>` wired to the bridge; return (name, address)."""
    ns = netns_name(index)
    address = pod_address(index)
    host_veth, pod_veth = f"cv{index}h", f"cv{index}p"
    delete_pod_netns(index=index)
    if not _link_exists(BRIDGE):
        # Deleted under a running cluster (by hand, or an old devcluster's
        # `down`): recreate it rather than fail every pod from now on.
        ensure_bridge()
    _ip("netns", "add", ns)
    _ip("link", "add", host_veth, "type", "veth", "peer", "name", pod_veth)
    _ip("link", "set", pod_veth, "netns", ns)
    _ip("link", "set", host_veth, "master", BRIDGE)
    _ip("link", "set", host_veth, "up")
    _ip("link", "set", pod_veth, "name", "eth0", netns=ns)
    _ip("addr", "add", f"{address}/{PREFIX_LENGTH}", "dev", "eth0", netns=ns)
    _ip("link", "set", "eth0", "up", netns=ns)
    _ip("link", "set", "lo", "up", netns=ns)
    _ip("route", "add", "default", "via", GATEWAY, netns=ns)
    etc = ETC_NETNS / ns
    etc.mkdir(parents=True, exist_ok=True)
    write_in_place(etc / "hosts", f"127.0.0.1 localhost\n{address} {hostname}\n")
    (etc / "hostname").write_text(hostname + "\n")
    return ns, address


def delete_pod_netns(*, index: int) -> None:
    ns = netns_name(index)
    _ip("netns", "del", ns, check=False)
    host_veth = f"cv{index}h"
    if _link_exists(host_veth):
        _ip("link", "del", host_veth, check=False)
    etc = ETC_NETNS / ns
    for child in etc.glob("*") if etc.exists() else ():
        child.unlink()
    if etc.exists():
        etc.rmdir()


def write_in_place(path: pathlib.Path, text: str) -> None:
    """Truncate and rewrite: a rename would leave the bind mount on the old inode."""
    with path.open("a+") as handle:
        handle.seek(0)
        if handle.read() == text:
            return
        handle.seek(0)
        handle.truncate()
        handle.write(text)


def remove_all() -> None:
    """Remove every cairn- namespace, its veth and /etc/netns entry, and the bridge."""
    listing = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listing:
        name = line.split(" ", 1)[0]
        if name.startswith(NETNS_PREFIX) and name[len(NETNS_PREFIX) :].isdigit():
            delete_pod_netns(index=int(name[len(NETNS_PREFIX) :]))
    if _link_exists(BRIDGE):
        _ip("link", "del", BRIDGE, check=False)
