"""NetworkPolicy enforcement with real packets, on network namespaces of its own.

The agent's `netfilter.Enforcer` (fed the API's JSON shapes as its informers
would) loads nftables rules into pod A's namespace. Three namespaces on a
private bridge (not the devcluster's `cairn0`, so the shared cluster is not
touched) stand for job pods A and B and an outside pod C; A serves TCP 29500.
Covers: no policy, C connects; a policy allowing ingress to the job's pods
only from the job's pods, C's connect times out (bounded: 2 s) while B's
works and A reaches itself over loopback; deleting the policy, C connects
again; an older pod of the same name detaching its own namespace leaves A's
rules in force. Needs root and nft (the devcluster needs both anyway).
"""

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from cairn.devcluster.agent import netfilter

TAG = f"np{os.getpid() % 100000}"
BRIDGE = f"{TAG}br"
SUBNET = "10.251.0"
PORT = 29500
JOB = {"cairn.dev/job-name": "j1"}
SERVER = f"""
import socket
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(('0.0.0.0', {PORT}))
srv.listen()
print('listening', flush=True)
while True:
    conn, _ = srv.accept()
    conn.sendall(b'hello')
    conn.close()
"""
CONNECT = """
import socket, sys
try:
    conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)
    print(conn.recv(16).decode())
except OSError as exc:
    print(type(exc).__name__)
"""


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=10)


def _pod(name: str, index: int, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "team", "labels": labels},
        "spec": {"containers": [{"name": "c"}]},
        "status": {"phase": "Running", "podIP": f"{SUBNET}.{index}"},
    }


@pytest.fixture
def three_netns() -> Iterator[dict[str, str]]:
    names = {pod: f"{TAG}-{pod}" for pod in ("a", "b", "c")}
    try:
        _sh("ip", "link", "add", BRIDGE, "type", "bridge")
        _sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        _sh("ip", "link", "set", BRIDGE, "up")
        for index, (pod, ns) in enumerate(names.items(), start=2):
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", f"{TAG}{pod}h", "type", "veth", "peer", "name", f"{TAG}{pod}p")
            _sh("ip", "link", "set", f"{TAG}{pod}p", "netns", ns)
            _sh("ip", "link", "set", f"{TAG}{pod}h", "master", BRIDGE, "up")
            _sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{index}/24", "dev", f"{TAG}{pod}p")
            _sh("ip", "-n", ns, "link", "set", f"{TAG}{pod}p", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield names
    finally:
        for pod, ns in names.items():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
            subprocess.run(["ip", "link", "del", f"{TAG}{pod}h"], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, check=False)


@pytest.fixture
def server(three_netns: dict[str, str]) -> Iterator[None]:
    argv = ["ip", "netns", "exec", three_netns["a"], sys.executable, "-c", SERVER]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
        yield
    finally:
        proc.kill()
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def _connect(netns: str, target: str) -> str:
    argv = ["ip", "netns", "exec", netns, sys.executable, "-c", CONNECT, target, str(PORT)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=True)
    return proc.stdout.strip()


def _job_policy() -> dict[str, Any]:
    return {
        "metadata": {"name": "job-j1", "namespace": "team"},
        "spec": {
            "podSelector": {"matchLabels": JOB},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": JOB}}]}],
        },
    }


def test_policy_blocks_outsider_admits_job_pod_and_lifts(
    three_netns: dict[str, str], server: None
) -> None:
    a_ip = f"{SUBNET}.2"
    enforcer = netfilter.Enforcer()
    enforcer.on_namespace("ADDED", {"metadata": {"name": "team", "labels": {}}})
    for index, (name, labels) in enumerate((("a", JOB), ("b", JOB), ("c", {})), start=2):
        enforcer.on_pod("ADDED", _pod(name, index, labels))
    enforcer.attach(pod=_pod("a", 2, JOB), netns=three_netns["a"], address=a_ip)  # applies
    assert _connect(three_netns["c"], a_ip) == "hello"  # no policy: open

    enforcer.on_policy("ADDED", _job_policy())
    enforcer.sync()  # what the agent's `Enforcer.run` thread does after a burst
    assert _connect(three_netns["c"], a_ip) == "TimeoutError"  # dropped: 2 s connect timeout
    assert _connect(three_netns["b"], a_ip) == "hello"
    assert _connect(three_netns["a"], "127.0.0.1") == "hello"

    enforcer.on_policy("DELETED", _job_policy())
    enforcer.sync()
    assert _connect(three_netns["c"], a_ip) == "hello"

    # An older pod of the same name leaving its own namespace does not untrack A's.
    enforcer.detach(pod=_pod("a", 2, JOB), netns=f"{TAG}-gone")
    enforcer.on_policy("ADDED", _job_policy())
    enforcer.sync()
    assert _connect(three_netns["c"], a_ip) == "TimeoutError"
