"""The step-time dip of saving every step (issue #23 item 4), side by side in one run.

2 ranks (gloo on CPU, `DistributedDataParallel`), a stack of ``Linear``
layers with AdamW (default 4 x Linear(2048, 2048): 17M parameters), the
reference trainer's loop order: forward + backward, ``wait_until_staged()``,
``optimizer.step()``, ``ckpt.save(step, objects)`` on every step (the
manager's ``interval_steps`` decides). Arms, every one over the same steps:

- ``none``: no CheckpointManager (the step time to compare against);
- ``every_step_memory``: ``interval_steps=1``, the memory tier on (a folder
  under /dev/shm per rank, ``memory_replicas=1``: each rank's copy also
  pushed to the other rank's replica server), S3 uploads only every M steps
  (``upload_interval_steps=M``, default 10): item 4;
- ``every_step_upload_all``: the same with every step uploaded (what saving
  every step costs without item 4);
- ``every_m``: ``interval_steps=M``, every save uploaded, no memory tier
  (the usual configuration before item 4).

The arms run interleaved: in each round every arm runs one block of M
steps, in an order rotated per round (the machine is shared and its load
drifts; no arm always goes first). Each block of an arm with saves opens a
fresh manager on its own volume folders, memory folders and S3 prefix,
makes one untimed warm-up save (the stager's buffers are allocated once per
run in real training) and drains it, then times steps M/2+1 .. M/2+M, so
the block's upload step (a multiple of M) falls mid-block and the steps
after it carry its background work. The last save's background work and
the manager's close (a clean end uploads the newest local-only step:
``upload_backlog.promote_newest``) are timed apart, not in a step.

A step's time is the slower rank's. Printed per arm and recorded in
``bench/results/save-every-step-<params>-<UTC>.json``: median and p90 step
time, mean extra seconds per step over ``none`` ((sum of step times -
steps x median(none)) / steps), the dip ratio median / median(none), the
steps whose manifest S3 holds (listed from the bucket), the saves committed
in the timed steps, rank 0's medians of a step's parts (forward +
backward, ``wait_until_staged()``, ``optimizer.step()``, ``save()``: on 2
shared cores the background writer slows the training thread's compute
too), the bytes of a step by rank, the drain and close seconds.

Usage: PYTHONPATH=api:operator:trainer_image:devcluster python bench/save_every_step.py
       [--layers 4] [--dim 2048] [--tokens 64] [--m 10] [--rounds 3] [--no-record]
Needs the devcluster up (its S3, SeaweedFS). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import statistics
import tempfile
import time
import typing
import uuid

import ranks
import record  # bench/, next to this script
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from cairn.api import manifest as manifest_mod
from cairn.checkpoint import events, layout, manager, options, state
from cairn.devcluster import cluster as cluster_mod

RANKS = 2
ARMS = ("none", "every_step_memory", "every_step_upload_all", "every_m")
TIMED_PHASES = ("staged", "written", "committed", "memory_kept", "uploaded")
MANIFEST_KEY = re.compile(r"(?:^|/)step-(\d+)/manifest\.json$")


# -- pure decisions ---------------------------------------------------------------


def block_steps(m: int) -> range:
    """The timed steps of a block: M steps around the upload step M. Pure."""
    half = m // 2
    return range(half + 1, half + m + 1)


def arm_order(round_index: int) -> tuple[str, ...]:
    """The arms of a round, rotated by the round's index. Pure."""
    shift = round_index % len(ARMS)
    return ARMS[shift:] + ARMS[:shift]


def uploaded_steps(keys: typing.Iterable[str]) -> list[int]:
    """The steps whose manifest is among the S3 keys (a step is uploaded once its
    manifest is). Pure."""
    found = (MANIFEST_KEY.search(k) for k in keys)
    return sorted(int(m.group(1)) for m in found if m is not None)


def slower_rank(per_rank: list[list[float]]) -> list[float]:
    """Each step's time as the slower rank's. Pure."""
    return [max(times) for times in zip(*per_rank, strict=True)]


def summarize(step_s: list[float], *, none_median: float) -> dict[str, float]:
    """Median, p90, mean extra seconds per step over `none`, dip ratio. Pure."""
    median = statistics.median(step_s)
    return {
        "steps": len(step_s),
        "median_step_s": median,
        "p90_step_s": statistics.quantiles(step_s, n=10, method="inclusive")[8],
        "mean_extra_s_per_step": (sum(step_s) - len(step_s) * none_median) / len(step_s),
        "dip_ratio": median / none_median,
    }


# -- one rank -----------------------------------------------------------------------


class Trainer:
    """The model (DDP over gloo), AdamW, a fixed batch and the checkpointed objects."""

    def __init__(self, *, layers: int, dim: int, tokens: int, seed: int) -> None:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)])
        self.model = DistributedDataParallel(model)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.batch = torch.randn(tokens, dim)
        self.objects: dict[str, state.Stateful] = {
            "model_optim": state.ModelOptimizerState(self.model, self.optim)
        }
        self.params = sum(p.numel() for p in model.parameters())

    def forward_backward(self) -> None:
        self.model(self.batch).square().mean().backward()

    def optimizer_step(self) -> None:
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)


def arm_options(
    arm: str, *, cfg: dict[str, typing.Any], round_index: int, rank: int
) -> options.CheckpointOptions | None:
    """The manager's options of one arm's block on this rank (None: `none`)."""
    if arm == "none":
        return None
    m = cfg["m"]
    block = f"{arm}-r{round_index}"
    every_step = arm.startswith("every_step")
    s3 = options.S3Options(**{**cfg["s3"], "uri": f"{cfg['s3']['uri']}/{arm}/r{round_index}"})
    return options.CheckpointOptions(
        directory=pathlib.Path(cfg["workdir"]) / block / f"pod-{rank}",
        interval_steps=1 if every_step else m,
        s3=s3,
        upload_interval_steps=m if arm == "every_step_memory" else None,
        memory_dir=pathlib.Path(cfg["shm"]) / block / f"mem-{rank}" if every_step else None,
        memory_replicas=1,
        job_uid=cfg["job_uid"],
        manifest_keyring=manifest_mod.parse_keyring(cfg["keyring"]),
        timeout_seconds=300.0,
    )


def timed_steps(
    t: Trainer, steps: range, ckpt: manager.CheckpointManager | None
) -> dict[str, list[float]]:
    """The loop of the reference trainer; each step timed whole, and its
    `wait_until_staged()` and `save()` apart."""
    out: dict[str, list[float]] = {
        "step_s": [],
        "fwd_bwd_s": [],
        "staged_wait_s": [],
        "optim_s": [],
        "save_block_s": [],
    }
    for step in steps:
        t0 = time.perf_counter()
        t.forward_backward()
        t1 = time.perf_counter()
        if ckpt is not None:
            ckpt.wait_until_staged()
        t2 = time.perf_counter()
        t.optimizer_step()
        t3 = time.perf_counter()
        if ckpt is not None:
            ckpt.save(step, t.objects)
        t4 = time.perf_counter()
        out["step_s"].append(t4 - t0)
        out["fwd_bwd_s"].append(t1 - t0)
        out["staged_wait_s"].append(t2 - t1)
        out["optim_s"].append(t3 - t2)
        out["save_block_s"].append(t4 - t3)
    return out


def run_block(
    t: Trainer, arm: str, *, cfg: dict[str, typing.Any], round_index: int, rank: int
) -> dict[str, typing.Any]:
    """One arm's block: fresh manager, untimed warm-up save, M timed steps, drain."""
    steps = block_steps(cfg["m"])
    opts = arm_options(arm, cfg=cfg, round_index=round_index, rank=rank)
    if opts is None:
        return {"arm": arm, **timed_steps(t, steps, None)}
    committed: list[int] = []
    phases: dict[str, list[float]] = {}
    """This rank's seconds of each writer phase of the timed steps (why a step waits)."""

    def on_event(event: events.ProgressEvent) -> None:
        if event.rank != rank or event.step not in steps:
            return
        if event.phase == "committed":
            committed.append(event.step)
        if event.phase in TIMED_PHASES:
            phases.setdefault(event.phase, []).append(event.seconds)

    t0 = time.perf_counter()
    with manager.CheckpointManager(opts, callbacks=[on_event]) as ckpt:
        ckpt.save(steps.start - 1, t.objects, force=True)  # warm-up, untimed
        ckpt.wait_until_finished()
        warmup_s = time.perf_counter() - t0
        folder = layout.step_dir(opts.directory, steps.start - 1)
        step_bytes = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        out: dict[str, typing.Any] = {"arm": arm, **timed_steps(t, steps, ckpt)}
        t1 = time.perf_counter()
        ckpt.wait_until_finished()
        t2 = time.perf_counter()
    out.update(
        warmup_s=warmup_s,
        step_bytes=step_bytes,
        drain_s=t2 - t1,
        close_s=time.perf_counter() - t2,
        committed=sorted(committed),
        phase_s=phases,
    )
    # This rank's folders only: the other rank may still be draining its own.
    shutil.rmtree(opts.directory, ignore_errors=True)
    if opts.memory_dir is not None:
        shutil.rmtree(opts.memory_dir, ignore_errors=True)
    return out


def rank_main(cfg: dict[str, typing.Any]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    t = Trainer(layers=cfg["layers"], dim=cfg["dim"], tokens=cfg["tokens"], seed=cfg["seed"])
    timed_steps(t, range(3), None)  # warm-up of the training loop itself
    blocks = []
    for round_index in range(cfg["rounds"]):
        for arm in arm_order(round_index):
            blocks.append(run_block(t, arm, cfg=cfg, round_index=round_index, rank=rank))
            blocks[-1]["round"] = round_index
            dist.barrier()  # no block starts while a rank still closes the last one
    result = {"rank": rank, "params": t.params, "blocks": blocks}
    (pathlib.Path(cfg["workdir"]) / f"result-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


# -- the driver ---------------------------------------------------------------------


def list_keys(client: typing.Any, bucket: str, prefix: str) -> list[str]:
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [obj["Key"] for obj in page.get("Contents", [])]
    return keys


def arm_figures(
    results: list[dict[str, typing.Any]], arm: str, *, none_median: float
) -> dict[str, typing.Any]:
    """One arm's figures from both ranks' blocks (its steps concatenated over the rounds)."""
    mine = [[b for b in r["blocks"] if b["arm"] == arm] for r in results]
    per_rank = [[s for b in blocks for s in b["step_s"]] for blocks in mine]
    figures: dict[str, typing.Any] = summarize(slower_rank(per_rank), none_median=none_median)
    rank0 = mine[0]
    for key in ("fwd_bwd_s", "optim_s", "save_block_s", "staged_wait_s"):
        figures[f"{key}_median"] = statistics.median(s for b in rank0 for s in b[key])
    for key in ("warmup_s", "drain_s", "close_s"):
        if arm != "none":
            figures[f"{key}_median"] = statistics.median(b[key] for b in rank0)
    if arm != "none":
        figures["committed_saves"] = sum(len(b["committed"]) for b in rank0)
        figures["step_bytes_by_rank"] = [blocks[0]["step_bytes"] for blocks in mine]
        figures["writer_phase_s_median"] = {
            phase: statistics.median(s for b in rank0 for s in b["phase_s"].get(phase, []))
            for phase in TIMED_PHASES
            if any(b["phase_s"].get(phase) for b in rank0)
        }
    return figures


def report(
    results: list[dict[str, typing.Any]], uploads: dict[str, list[list[int]]], *, m: int
) -> dict[str, typing.Any]:
    """Every arm's figures, printed as a table and returned."""
    none_rank = [
        [s for b in r["blocks"] if b["arm"] == "none" for s in b["step_s"]] for r in results
    ]
    none_median = statistics.median(slower_rank(none_rank))
    timed = set(block_steps(m))
    arms: dict[str, typing.Any] = {}
    print("\nstep time = the slower rank's; columns after 'dip': rank 0's medians, ms")
    print(
        f"{'arm':<23}{'median ms':>10}{'p90 ms':>9}{'extra ms/step':>15}{'dip':>7}"
        f"{'fwd+bwd':>9}{'optim':>7}{'staged':>8}{'save()':>8}{'committed':>11}"
        f"{'in S3 (timed)':>15}"
    )
    for arm in ARMS:
        f = arm_figures(results, arm, none_median=none_median)
        steps = uploads.get(arm, [])
        f["uploaded_steps_by_round"] = steps
        f["uploaded_steps"] = sum(len(s) for s in steps)
        f["uploaded_timed_steps"] = sum(len([x for x in s if x in timed]) for s in steps)
        arms[arm] = f
        print(
            f"{arm:<23}{f['median_step_s'] * 1e3:>10.1f}{f['p90_step_s'] * 1e3:>9.1f}"
            f"{f['mean_extra_s_per_step'] * 1e3:>15.1f}{f['dip_ratio']:>7.2f}"
            f"{f['fwd_bwd_s_median'] * 1e3:>9.1f}{f['optim_s_median'] * 1e3:>7.1f}"
            f"{f['staged_wait_s_median'] * 1e3:>8.1f}{f['save_block_s_median'] * 1e3:>8.1f}"
            f"{f.get('committed_saves', 0):>11}"
            f"{f['uploaded_steps']:>8} ({f['uploaded_timed_steps']})"
        )
    for arm in ARMS[1:]:
        f = arms[arm]
        print(
            f"  {arm}: warm-up {f['warmup_s_median']:.2f}s, drain after the block "
            f"{f['drain_s_median']:.2f}s, close {f['close_s_median']:.2f}s (medians); "
            f"S3 steps by round {f['uploaded_steps_by_round']}; "
            f"a step's bytes by rank {f['step_bytes_by_rank']}"
        )
        phases = ", ".join(f"{k} {v:.2f}s" for k, v in f["writer_phase_s_median"].items())
        print(f"    rank 0's writer phases (event seconds, medians): {phases}")
    return {"none_median_step_s": none_median, "timed_steps": sorted(timed), "arms": arms}


def size_tag(params: int) -> str:
    """`17M`, or `0.13M` for a model under a million parameters. Pure."""
    return f"{params / 1e6:.0f}M" if params >= 1_000_000 else f"{params / 1e6:.2f}M"


def s3_config(client: typing.Any, cluster: cluster_mod.Cluster) -> dict[str, typing.Any]:
    bucket = f"cairn-bench-every-step-{uuid.uuid4().hex[:8]}"
    client.create_bucket(Bucket=bucket)
    creds = cluster.s3_credentials()
    return {
        "uri": f"s3://{bucket}/bench",
        "endpoint_url": cluster.s3_endpoint,
        "region": "us-east-1",
        "access_key": creds.access_key,
        "secret_key": creds.secret_key,
    }


def delete_bucket(client: typing.Any, bucket: str) -> None:
    for key in list_keys(client, bucket, ""):
        client.delete_object(Bucket=bucket, Key=key)
    client.delete_bucket(Bucket=bucket)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=64, help="rows of the batch per rank")
    parser.add_argument("--m", type=int, default=10, help="upload interval, block length")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--rank-config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.m < 2:
        parser.error("--m must be >= 2")
    return args


def main() -> None:
    args = parse_args()
    if args.rank_config:
        rank_main(json.loads(pathlib.Path(args.rank_config).read_text()))
        return
    env = record.environment()
    cluster = cluster_mod.Cluster.default()
    client = cluster.s3_client()
    s3 = s3_config(client, cluster)
    bucket = s3["uri"].removeprefix("s3://").split("/")[0]
    work = pathlib.Path(tempfile.mkdtemp(prefix="cairn-every-step-"))
    shm = pathlib.Path(tempfile.mkdtemp(prefix="cairn-every-step-", dir="/dev/shm"))
    ring = manifest_mod.Keyring(current="bench", keys={"bench": os.urandom(32)})
    cfg = {
        **{k: v for k, v in vars(args).items() if k not in ("no_record", "rank_config")},
        "workdir": str(work),
        "shm": str(shm),
        "s3": s3,
        "job_uid": f"bench-every-step-{uuid.uuid4()}",
        "keyring": manifest_mod.dump_keyring(ring).decode(),
    }
    try:
        t0 = time.monotonic()
        results = ranks.run_ranks(__file__, cfg, work=work, ranks=RANKS, timeout=1200)
        wall_s = time.monotonic() - t0
        uploads = {
            arm: [
                uploaded_steps(list_keys(client, bucket, f"bench/{arm}/r{i}/"))
                for i in range(args.rounds)
            ]
            for arm in ARMS[1:]
        }
        figures = report(results, uploads, m=args.m)
        figures["wall_s"] = wall_s
        figures["blocks"] = [r["blocks"] for r in results]
        params = {k: cfg[k] for k in ("layers", "dim", "tokens", "m", "rounds", "seed")}
        params.update(model_params=results[0]["params"], ranks=RANKS, torch_threads=1)
        print(
            f"{size_tag(params['model_params'])} params; run {wall_s:.0f}s; "
            f"load average now: {os.getloadavg()} (2 cores, shared)"
        )
        if not args.no_record:
            path = record.write(
                bench="save-every-step",
                tag=size_tag(params["model_params"]),
                env=env,
                params=params,
                figures=figures,
            )
            print(f"record: {path}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
        delete_bucket(client, bucket)


if __name__ == "__main__":
    main()
