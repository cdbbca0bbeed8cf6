"""Pod networking: headless-Service DNS names, TCP between pods, no port clashes.

Covers: two pods of a headless Service resolve each other's
`<hostname>.<subdomain>.<ns>.svc.cluster.local` names and exchange a message
over TCP on port 29500; two such pairs in different namespaces do so at the
same time, each pair's server bound to 0.0.0.0:29500 (as torchrun's store
binds), so they clash unless each pod has its own network namespace.
"""

import functools
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.devcluster import kube_helpers as kh

pytestmark = pytest.mark.cluster

SERVER = """
import socket, time
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(('0.0.0.0', 29500))
srv.listen()
print('listening', flush=True)
conn, _ = srv.accept()
msg = conn.recv(1024).decode()
conn.sendall(('echo ' + msg + ' from ' + socket.gethostname()).encode())
conn.close()
print('served ' + msg, flush=True)
time.sleep(1)
"""

CLIENT = """
import os, socket, time
target = 'server.{svc}.' + os.environ['NS'] + '.svc.cluster.local'
deadline = time.time() + 60
while True:
    try:
        addr = socket.gethostbyname(target)
        conn = socket.create_connection((target, 29500), timeout=5)
        break
    except OSError:
        if time.time() > deadline:
            raise
        time.sleep(0.3)
conn.sendall(os.environ['NS'].encode())
print('resolved ' + target + ' to ' + addr + ': ' + conn.recv(1024).decode(), flush=True)
"""


@pytest.fixture
def two_namespaces(devcluster: Any) -> Iterator[tuple[str, str]]:
    first = kh.temp_namespace(devcluster.core, "net")
    second = kh.temp_namespace(devcluster.core, "net")
    yield next(first), next(second)
    for gen in (first, second):
        next(gen, None)


def _pair(core: Any, namespace: str) -> None:
    core.create_namespaced_service(
        namespace,
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "ring"},
            "spec": {"clusterIP": "None", "selector": {"pair": "ring"}, "ports": [{"port": 29500}]},
        },
    )
    env = [{"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
    for name, code in (("server", SERVER), ("client", CLIENT.replace("{svc}", "ring"))):
        pod = kh.python_pod(name, code, hostname=name, subdomain="ring", container={"env": env})
        pod["metadata"]["labels"] = {"pair": "ring"}
        core.create_namespaced_pod(namespace, pod)


def _finished(core: Any, name: str, namespace: str) -> bool:
    return kh.pod_phase(core, name, namespace) in ("Succeeded", "Failed")


def test_two_pairs_resolve_and_talk_on_the_same_port(
    devcluster: Any, two_namespaces: tuple[str, str]
) -> None:
    core = devcluster.core
    for namespace in two_namespaces:
        _pair(core, namespace)
    for namespace in two_namespaces:
        for name in ("server", "client"):
            kh.wait_for(
                functools.partial(_finished, core, name, namespace),
                timeout=120,
                what=f"{namespace}/{name} to finish",
            )
            assert kh.pod_phase(core, name, namespace) == "Succeeded", kh.pod_log(
                core, name, namespace
            )
        server_ip = core.read_namespaced_pod("server", namespace).status.pod_ip
        client_log = kh.pod_log(core, "client", namespace)
        fqdn = f"server.ring.{namespace}.svc.cluster.local"
        assert f"resolved {fqdn} to {server_ip}: echo {namespace} from server" in client_log
        assert f"served {namespace}" in kh.pod_log(core, "server", namespace)
    ips = {core.read_namespaced_pod("server", ns).status.pod_ip for ns in two_namespaces}
    assert len(ips) == 2
