"""A restarted worker's first second, on real parts: rank 0's store and the fork server.

Covers, each in a child interpreter with the locked torch:

- `storewait.wait_for_master_store` against a real TCPStore: with nothing
  listening it gives up at its deadline (False); with rank 0's store started
  half a second later it returns True once the store listens, and its probe
  connection is not counted as a worker (rank 0's constructor, which waits
  for both workers, still waits half a second later); a real client then
  joins and rank 0's store completes.
- `launch.server_preload` on a real ``forkserver``: `cairn.trainer.forkprep`
  runs last in the server, so a fork inherits a frozen heap (its full
  collection walks only its own objects) and botocore's warm model cache
  (the S3 client is built without reading the models again); a warm-up
  that fails is logged and never stops the server.

Seconds are printed, never asserted (timing lives in bench/mttr.py).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.torch

STORE_CHILD = textwrap.dedent(
    """
    import json, socket, threading, time
    from datetime import timedelta

    import torch.distributed as dist

    from cairn.trainer import storewait

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    out = {}
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    out["nobody"] = storewait.wait_for_master_store(
        {**env, "MASTER_PORT": str(free_port())}, deadline_seconds=0.3
    )

    port = free_port()
    master = {}

    def rank0():
        time.sleep(0.5)
        master["store"] = dist.TCPStore(
            "127.0.0.1", port, world_size=2, is_master=True, wait_for_workers=True,
            timeout=timedelta(seconds=60),
        )

    thread = threading.Thread(target=rank0)
    thread.start()
    started = time.monotonic()
    out["waited"] = storewait.wait_for_master_store({**env, "MASTER_PORT": str(port)})
    out["wait_s"] = time.monotonic() - started
    # Had the probe counted as the second worker, rank 0's constructor would
    # return within milliseconds; half a second later it still waits.
    thread.join(0.5)
    out["rank0_still_waiting"] = thread.is_alive()
    started = time.monotonic()
    worker = dist.TCPStore(
        "127.0.0.1", port, world_size=2, is_master=False, wait_for_workers=True,
        timeout=timedelta(seconds=60),
    )
    out["worker_connect_s"] = time.monotonic() - started
    thread.join(60)
    out["rank0_done"] = not thread.is_alive()
    worker.set("k", "v")
    out["shared"] = master["store"].get("k").decode()
    print(json.dumps(out))
    """
)

PROBE_MODULE = textwrap.dedent(
    """
    import gc, time

    def probe(queue):
        from cairn.checkpoint import options, s3transport

        started = time.monotonic()
        gc.collect()
        collect_s = time.monotonic() - started
        inherited = s3transport._shared_loader.cache_info().currsize == 1
        loader = s3transport._shared_loader()
        cached = len(loader._cache) if inherited else 0
        started = time.monotonic()
        s3transport.make_client(options.S3Options(
            uri="s3://b/p", endpoint_url="http://127.0.0.1:9", access_key="a", secret_key="b"
        ))
        client_s = time.monotonic() - started
        queue.put({
            "frozen": gc.get_freeze_count(),
            "cached_before_client": cached,
            "same_loader": s3transport._shared_loader() is loader,
            "collect_s": collect_s,
            "client_s": client_s,
        })
    """
)

FORK_CHILD = textwrap.dedent(
    """
    import json, multiprocessing

    from cairn.trainer import launch
    import forkprobe

    if __name__ == "__main__":
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(launch.server_preload(["torch", "cairn.checkpoint.manager"]))
        queue = ctx.Queue()
        worker = ctx.Process(target=forkprobe.probe, args=(queue,))
        worker.start()
        got = queue.get(timeout=120)
        worker.join(60)
        print(json.dumps({**got, "exitcode": worker.exitcode}))
    """
)


def _run(script: pathlib.Path, env: dict[str, str] | None = None) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    print(result)
    return result


def test_a_worker_waits_for_rank_zeros_store_without_counting_as_one(
    tmp_path: pathlib.Path,
) -> None:
    script = tmp_path / "store_child.py"
    script.write_text(STORE_CHILD)
    got = _run(script)
    assert got["nobody"] is False  # nothing listened: the deadline, then torch's own connect
    assert got["waited"] is True
    assert got["rank0_still_waiting"] is True  # the probe was not counted as a worker
    assert got["rank0_done"] is True  # the real worker was
    assert got["shared"] == "v"


def test_a_fork_of_the_server_inherits_a_frozen_heap_and_botocores_models(
    tmp_path: pathlib.Path,
) -> None:
    (tmp_path / "forkprobe.py").write_text(PROBE_MODULE)
    script = tmp_path / "fork_child.py"
    script.write_text(FORK_CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    got = _run(script, env)
    assert got["exitcode"] == 0
    assert isinstance(got["frozen"], int) and got["frozen"] > 100_000  # torch's heap, frozen
    assert isinstance(got["cached_before_client"], int) and got["cached_before_client"] > 0
    assert got["same_loader"] is True


def test_a_failed_warm_up_never_stops_the_fork_server() -> None:
    """forkprep runs as a preload, where anything but ImportError would end the
    server (and every worker with it): a botocore failure is logged, the heap
    is still frozen."""
    child = textwrap.dedent(
        """
        import gc, json
        from cairn.checkpoint import s3transport

        def broken():
            raise ValueError("AWS_CA_BUNDLE points nowhere")

        s3transport.warm_loader = broken
        import cairn.trainer.forkprep
        print(json.dumps({"frozen": gc.get_freeze_count()}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["frozen"] > 0
    assert "botocore's models not preloaded (AWS_CA_BUNDLE points nowhere)" in done.stderr
