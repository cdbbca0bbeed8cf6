"""Where the devcluster keeps its state, caches and built binaries.

Pure: maps a state directory to the paths of every file the other modules
read or write, so that no module invents a path of its own. Nothing here
touches the file system.
"""

import dataclasses
import os
import pathlib

STATE_ENV = "CAIRN_DEVCLUSTER_STATE"
CACHE_ENV = "CAIRN_CACHE_DIR"


def cache_root() -> pathlib.Path:
    """The cache shared by every checkout: built binaries and Go build cache."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return pathlib.Path(configured)
    return pathlib.Path.home() / ".cache" / "cairn"


def default_state_dir() -> pathlib.Path:
    configured = os.environ.get(STATE_ENV)
    if configured:
        return pathlib.Path(configured)
    return cache_root() / "devcluster" / "state"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StatePaths:
    """Every path inside one devcluster's state directory."""

    root: pathlib.Path

    @property
    def pki(self) -> pathlib.Path:
        return self.root / "pki"

    @property
    def logs(self) -> pathlib.Path:
        return self.root / "logs"

    @property
    def pids(self) -> pathlib.Path:
        return self.root / "pids"

    @property
    def etcd_data(self) -> pathlib.Path:
        return self.root / "etcd"

    @property
    def s3_data(self) -> pathlib.Path:
        return self.root / "s3"

    @property
    def tmp(self) -> pathlib.Path:
        """TMPDIR for the servers we start, so they leave nothing in /tmp."""
        return self.root / "tmp"

    @property
    def admin_kubeconfig(self) -> pathlib.Path:
        return self.root / "admin.kubeconfig"

    @property
    def env_file(self) -> pathlib.Path:
        return self.root / "env.sh"

    @property
    def info_file(self) -> pathlib.Path:
        return self.root / "cluster.json"

    @property
    def host_claim(self) -> pathlib.Path:
        """Present while this state dir owns the host-wide parts (bridge, pod
        namespaces, SeaweedFS's /tmp sockets): only its owner may remove them."""
        return self.root / "host-claim"

    def kubeconfig(self, component: str) -> pathlib.Path:
        return self.root / f"{component}.kubeconfig"

    def log(self, component: str) -> pathlib.Path:
        return self.logs / f"{component}.log"

    def pidfile(self, component: str) -> pathlib.Path:
        return self.pids / f"{component}.pid"
