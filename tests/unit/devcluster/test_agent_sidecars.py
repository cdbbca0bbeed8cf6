"""The node agent's ordering of native sidecars (init containers with restartPolicy Always).

Covers: a regular init container holds back what follows until it finished;
a sidecar only until it started (and never again after a restart); the app
containers of a pod with a sidecar start while the sidecar runs (the
devcluster case: tests/integration/operator/test_pod_security.py).
"""

from cairn.devcluster.agent import podstatus


def _init(*, sidecar: bool) -> podstatus.Container:
    spec = {"name": "s" if sidecar else "i", "command": ["true"]}
    if sidecar:
        spec["restartPolicy"] = "Always"
    return podstatus.Container(spec=spec, init=True)


def test_regular_init_blocks_until_done() -> None:
    init = _init(sidecar=False)
    assert podstatus.blocks_start(init) and not podstatus.is_sidecar(init)
    init.done = True
    assert not podstatus.blocks_start(init)


def test_sidecar_blocks_only_until_started() -> None:
    sidecar = _init(sidecar=True)
    assert podstatus.is_sidecar(sidecar) and podstatus.blocks_start(sidecar)
    sidecar.restart_count = 1  # it ran once and is in back-off now
    assert podstatus.started(sidecar)
    assert not podstatus.blocks_start(sidecar)
    app = podstatus.Container(spec={"name": "a", "restartPolicy": "Always"}, init=False)
    assert not podstatus.is_sidecar(app), "restartPolicy on an app container is not a sidecar"
