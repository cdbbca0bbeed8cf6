"""A second node agent for tests that need agent code newer than the shared one's.

`python -m tests.integration.devcluster.private_agent --state-dir D
--kubeconfig K --node SPEC --kubelet-port-base P` runs `agent.main.Agent`
for its own (tainted) node beside the devcluster's agent, with two changes
so it cannot disturb the shared cluster: it provisions no volumes (the
shared agent does) and it takes network namespace indices from
`INDEX_BASE` up, far above the shared agent's lowest-free allocation.
"""

import argparse
import contextlib
import dataclasses
import logging
import pathlib
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from cairn.devcluster import network
from cairn.devcluster.agent import main
from tests.integration.devcluster import kube_helpers as kh

INDEX_BASE = 40000


def _agent(argv: list[str]) -> main.Agent:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-dir", required=True)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--node", action="append", required=True)
    parser.add_argument("--kubelet-port-base", type=int, required=True)
    parser.add_argument("--restart-backoff-seconds", type=float, default=10.0)
    agent = main.Agent(args=parser.parse_args(argv))

    def allocate() -> int:
        with agent.lock:
            index = next(
                i
                for i in range(INDEX_BASE, INDEX_BASE + 10000)
                if i not in agent.used_indices and not network.netns_exists(i)
            )
            agent.used_indices.add(index)
            return index

    def ignore(event: str, obj: dict[str, Any]) -> None:
        del event, obj

    agent.ctx = dataclasses.replace(agent.ctx, allocate_index=allocate)
    agent.provisioner.on_claim = ignore  # type: ignore[method-assign,assignment]
    agent.provisioner.on_volume = ignore  # type: ignore[method-assign,assignment]
    return agent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def running(*, devcluster: Any, node: str, log_path: pathlib.Path) -> Iterator[str]:
    """Run the private agent for `node` (`name:label.…,taint.…`) until the block ends,
    then stop it and delete its Node. Pods left on the node wait for pod GC: delete
    them (and wait) inside the block."""
    argv = [sys.executable, "-m", "tests.integration.devcluster.private_agent"]
    argv += ["--state-dir", str(devcluster.state_dir), "--kubeconfig", str(devcluster.kubeconfig)]
    argv += ["--node", node, "--kubelet-port-base", str(_free_port())]
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stderr=log, cwd=pathlib.Path(__file__).parents[3])
    try:
        kh.wait_for(
            lambda: proc.poll() is not None or "agent ready" in log_path.read_text(),
            timeout=60,
            what="the private agent to start",
        )
        assert proc.poll() is None, log_path.read_text()[-2000:]
        yield node.partition(":")[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        devcluster.core.delete_node(node.partition(":")[0])


if __name__ == "__main__":
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(main.JsonFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    private = _agent(sys.argv[1:])
    signal.signal(signal.SIGTERM, lambda *_: private.stop.set())
    sys.exit(private.run())
