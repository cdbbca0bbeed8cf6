"""Shared fixtures: the real S3 server and the devcluster.

- `s3_server` (session): a standalone SeaweedFS on loopback, for tests of
  uploads and downloads that need no cluster.
- `devcluster` (session): the local Kubernetes control plane with its node
  agent and S3. It is brought up if not running and left as found: a cluster
  that was already up stays up, one this session started is stopped at the
  end (set CAIRN_KEEP_DEVCLUSTER=1 to keep it for the next run).
- `operator` (per test, backed by `operator_process` per session): the CRD
  installed and THE operator of the devcluster running as its pidfile-tracked
  local process. There is one operator per devcluster, shared with other test
  sessions: it is started when not running (also again mid-session, if someone
  stopped it) and stopped at the end only if this session started it.
"""

import os
import pathlib
from collections.abc import Iterator

import pytest

from cairn.devcluster import cluster as devcluster_cluster
from cairn.devcluster import standalone_s3

TEST_S3_PORT = 19333


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[standalone_s3.S3Server]:
    root = tmp_path_factory.mktemp("s3-server")
    server = standalone_s3.start(root=root, s3_port=TEST_S3_PORT)
    try:
        yield server
    finally:
        server.stop()


EXTERNAL_KUBECONFIG_ENV = "CAIRN_TEST_KUBECONFIG"


class DevclusterHandle:
    """What a test needs to talk to the cluster under test."""

    def __init__(self, *, kubeconfig: pathlib.Path, target: devcluster_cluster.Cluster) -> None:
        from kubernetes import client, config

        self.target = target
        self.state_dir: pathlib.Path = target.state.root
        self.kubeconfig = kubeconfig
        self.api_client = config.new_client_from_config(config_file=str(kubeconfig))
        self.core = client.CoreV1Api(self.api_client)
        self.s3_endpoint = target.s3_endpoint
        self.s3_pod_endpoint = target.s3_pod_endpoint
        self.s3_credentials = target.s3_credentials()

    def require_devcluster(self) -> None:
        """Skip a test that checks the devcluster itself when a real cluster is used."""
        if os.environ.get(EXTERNAL_KUBECONFIG_ENV):
            pytest.skip("checks the devcluster's own internals; not on an external cluster")


@pytest.fixture(scope="session")
def devcluster() -> Iterator[DevclusterHandle]:
    target = devcluster_cluster.Cluster.default()
    external = os.environ.get(EXTERNAL_KUBECONFIG_ENV)
    if external:
        handle = DevclusterHandle(kubeconfig=pathlib.Path(external), target=target)
        yield handle
        handle.api_client.close()
        return
    report = devcluster_cluster.up(target)
    handle = DevclusterHandle(kubeconfig=target.state.admin_kubeconfig, target=target)
    try:
        yield handle
    finally:
        handle.api_client.close()
        if not report.already_running and not os.environ.get("CAIRN_KEEP_DEVCLUSTER"):
            devcluster_cluster.down(target)


class OperatorProcess:
    """The devcluster's one operator process, as this test session uses it."""

    def __init__(self, target: devcluster_cluster.Cluster) -> None:
        self.target = target
        self.started_here = False

    def ensure_running(self) -> None:
        from tests import demo

        if not demo.operator_running(self.target):
            demo.start_operator(self.target)
            self.started_here = True


@pytest.fixture(scope="session")
def operator_process(devcluster: DevclusterHandle) -> Iterator[OperatorProcess]:
    from tests import demo

    demo.install_crd(devcluster.api_client)
    handle = OperatorProcess(devcluster.target)
    handle.ensure_running()
    yield handle
    if handle.started_here:
        demo.stop_operator(devcluster.target)


@pytest.fixture
def operator(operator_process: OperatorProcess) -> OperatorProcess:
    operator_process.ensure_running()
    return operator_process
