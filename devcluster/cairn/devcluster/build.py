"""Building the pinned control-plane binaries from their Go modules.

The versions live in the wrapper modules under `devcluster/gomod/` (their
`go.mod` and committed `go.sum`); this module builds them once per version
into the cache outside the repository and reuses them after. A missing Go
toolchain, an unreachable module proxy or a failed compile each end in one
`DevclusterError` line naming the log to read.
"""

import contextlib
import dataclasses
import fcntl
import os
import pathlib
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

from cairn.devcluster import errors, paths

KUBERNETES_VERSION = "v1.34.3"
ETCD_VERSION = "v3.6.16"
KUEUE_VERSION = "v0.19.2"
GOMOD_DIR = pathlib.Path(__file__).resolve().parents[2] / "gomod"
MIN_GO = (1, 26)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Bundle:
    """One wrapper module and the commands it builds."""

    name: str
    version: str
    module_dir: pathlib.Path
    packages: tuple[str, ...]
    ldflags: str = ""

    @property
    def bin_dir(self) -> pathlib.Path:
        return paths.cache_root() / "bin" / f"{self.name}-{self.version}"

    def binary(self, command: str) -> pathlib.Path:
        return self.bin_dir / command

    @property
    def commands(self) -> tuple[str, ...]:
        return tuple(p.rsplit("/", 1)[-1] for p in self.packages)


def _kubernetes_ldflags(version: str) -> str:
    major, minor = version.lstrip("v").split(".")[:2]
    # The binaries report this version; without it they say v0.0.0 and
    # version-gated code paths (compatibility versions, kubectl skew) misbehave.
    flags = ["-s", "-w"]
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
        ]
    return " ".join(flags)


KUBERNETES = Bundle(
    name="kubernetes",
    version=KUBERNETES_VERSION,
    module_dir=GOMOD_DIR / "kubernetes",
    packages=(
        "k8s.io/kubernetes/cmd/kube-apiserver",
        "k8s.io/kubernetes/cmd/kube-controller-manager",
        "k8s.io/kubernetes/cmd/kube-scheduler",
        "k8s.io/kubernetes/cmd/kubectl",
    ),
    ldflags=_kubernetes_ldflags(KUBERNETES_VERSION),
)
ETCD = Bundle(
    name="etcd",
    version=ETCD_VERSION,
    module_dir=GOMOD_DIR / "etcd",
    packages=("cairn.dev/devcluster/etcd",),
    ldflags="-s -w",
)
KUEUE = Bundle(
    name="kueue",
    version=KUEUE_VERSION,
    module_dir=GOMOD_DIR / "kueue",
    packages=("sigs.k8s.io/kueue/cmd/kueue",),
    # Kueue logs this at start; without it it says v0.0.0-main.
    ldflags=f"-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion={KUEUE_VERSION}",
)
BUNDLES = (ETCD, KUBERNETES, KUEUE)


def is_built(bundle: Bundle) -> bool:
    return all(bundle.binary(c).is_file() for c in bundle.commands)


def _check_go() -> str:
    go = shutil.which("go")
    if go is None:
        raise errors.DevclusterError(
            "Go is not on PATH: install Go >= 1.26 (Debian: apt-get install golang, "
            "or the go.dev tarball) so devcluster can build kube-apiserver and etcd"
        )
    out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, check=False)
    version = out.stdout.strip().removeprefix("go")
    try:
        have = tuple(int(x) for x in version.split(".")[:2])
    except ValueError:
        have = (0, 0)
    if have < MIN_GO:
        raise errors.DevclusterError(
            f"Go {version or '?'} is too old: devcluster needs Go >= "
            f"{MIN_GO[0]}.{MIN_GO[1]} to build its pinned binaries"
        )
    return go


@contextlib.contextmanager
def _build_lock(bundle: Bundle) -> Iterator[None]:
    """One build of a bundle at a time across processes (bootstrap, tests, `up`):
    two would share, and delete, the same staging directory."""
    bundle.bin_dir.parent.mkdir(parents=True, exist_ok=True)
    with bundle.bin_dir.with_name(bundle.bin_dir.name + ".lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(bundle: Bundle, *, log: pathlib.Path) -> float:
    """Build `bundle` into its cache dir unless already there; return seconds spent."""
    if is_built(bundle):
        return 0.0
    with _build_lock(bundle):
        # Another process may have finished it while this one waited.
        return 0.0 if is_built(bundle) else _build(bundle, log=log)


def _build(bundle: Bundle, *, log: pathlib.Path) -> float:
    go = _check_go()
    staging = bundle.bin_dir.with_name(bundle.bin_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("CGO_ENABLED", "0")
    env["GOTOOLCHAIN"] = "local"
    argv = [go, "build", "-trimpath", "-ldflags", bundle.ldflags, "-o", f"{staging}/"]
    argv += list(bundle.packages)
    print(f"devcluster: building {bundle.name} {bundle.version} (log: {log})", file=sys.stderr)
    started = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run(
            argv, cwd=bundle.module_dir, env=env, stdout=out, stderr=subprocess.STDOUT, check=False
        )
    if proc.returncode != 0:
        text = log.read_text(errors="replace")
        if "proxy.golang.org" in text or "dial tcp" in text or "no such host" in text:
            raise errors.DevclusterError(
                f"cannot download Go modules for {bundle.name} {bundle.version}: the module "
                f"proxy is unreachable (check GOPROXY / network); details in {log}"
            )
        raise errors.DevclusterError(
            f"building {bundle.name} {bundle.version} failed (exit {proc.returncode}); see {log}"
        )
    shutil.rmtree(bundle.bin_dir, ignore_errors=True)
    staging.rename(bundle.bin_dir)
    return time.monotonic() - started


def build_all(*, log_dir: pathlib.Path) -> dict[str, float]:
    return {b.name: build(b, log=log_dir / f"build-{b.name}.log") for b in BUNDLES}
