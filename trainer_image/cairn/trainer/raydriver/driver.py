"""The driver loop: place, start a group, watch it, recover in place or exit.

    connect → placement group (one bundle per rank) → monitor actor
    loop:
        start group g: rank actors, MASTER_ADDR/PORT from rank 0's actor, run
        watch: every rank returned / an actor died / a node is gone / SIGTERM
        decide (`recovery.decide`): exit, or in place: monitor.advance(g+1),
            status.ray (API), kill the old actors, [a node gone: wait for
            its replacement, new placement group], start group g+1

The placement group survives in-place restarts (its bundles are freed when
the old actors die and taken by the new ones), so a restart costs new actor
processes, the process group and the restore, not a reservation; while a
group of CPU ranks trains, the next group's actors are started and warmed
(torch imported) as standbys in the same bundles (`standby`), so a restart
mostly costs the process group and the restore. A node of
the group that is gone (its pod lost: the operator puts a pod of the same
name in its place, docs/operator.md) pins its bundles to a node id that
will never come back, so then the driver waits (bounded, progress logged)
for a new Ray node and places the group again, every surviving node keeping
its ranks (`placement.keep_positions`). The monitor actor lives on the
driver's node, so no node loss takes the commit fence with it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
import types
import typing

import ray
from ray.experimental import internal_kv
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from cairn.api import exitcodes
from cairn.checkpoint import monitor as monitor_mod
from cairn.trainer import raynode_plan
from cairn.trainer.raydriver import placement, rank, recovery, standby
from cairn.trainer.raydriver import status as status_mod

log = logging.getLogger("cairn.trainer.raydriver")

FORWARDED_PREFIXES = ("CAIRN_", "AWS_", "TORCH", "NCCL_", "GLOO_", "OMP_")
"""The driver's env a rank actor gets (the head pod's contract, test settings)."""
FORWARDED_NAMES = ("TMPDIR", "PYTHONHASHSEED")
DRIVER_ONLY = ("CAIRN_TERMINATION_MESSAGE_PATH",)
WATCH_SECONDS = 0.2
KILL_WAIT_SECONDS = 30.0
PEER_DEATH_GRACE_SECONDS = 5.0
"""How long a rank's failure waits for a peer's death to be reported (Ray
reports an actor's death within about a second here; measured 0.3-0.4 s)."""
NODE_REPLACEMENT_SECONDS = 180.0
"""How long the driver waits for a lost node's replacement to join (the
operator's own bound on a replacement pod running, REPLACEMENT_DEADLINE_SECONDS
in its replaceplan, is the same: past it the attempt ends either way)."""
NODE_POLL_SECONDS = 0.2
PROGRESS_SECONDS = 5.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    target: str
    argv: list[str]
    nodes: int = 1
    procs_per_node: int = 1
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0
    max_inplace_restarts: int = 3
    grace_seconds: float | None = None
    """The final checkpoint's grace after SIGTERM (CAIRN_FINAL_CHECKPOINT_GRACE_SECONDS)."""
    start_timeout_seconds: float = 300.0
    """Bound on the placement group becoming ready and on actors starting."""
    standby: bool = True
    """Warm standby rank actors for the next in-place restart (CPU ranks;
    `cairn.trainer.raydriver.standby`); `--no-standby` turns them off."""
    address: str | None = None
    namespace: str | None = None


@dataclasses.dataclass(kw_only=True)
class Group:
    generation: int
    actors: list[typing.Any]
    runs: list[typing.Any]
    pids: list[int]
    node_ids: list[str]
    started: float
    new_node: bool = False
    """Some rank runs on another node than in the group before (a lost node
    replaced, `_replace_lost_nodes`)."""


class Driver:
    """One driver run; `run()` returns the process exit code."""

    def __init__(
        self,
        cfg: Config,
        *,
        env: typing.Mapping[str, str] | None = None,
        reporter: status_mod.Reporter | None = None,
    ) -> None:
        self.cfg = cfg
        self._env = dict(os.environ if env is None else env)
        self._reporter = reporter
        self._preempt = threading.Event()
        self._preempt_at: float | None = None
        self._preempt_sent = False
        self.restarts = 0
        self.groups: list[Group] = []
        self._monitor: typing.Any = None
        self._pg: typing.Any = None
        self._layout: placement.Layout | None = None
        self._node_order: list[str] = []
        """The placement's nodes by node rank (0: the driver's)."""
        self._standbys: list[typing.Any] = []
        """The next group's rank actors, started and warming (`standby`)."""
        self._standby_generation: int | None = None
        self._standby_warming: list[typing.Any] = []
        """Their `prepare` results not yet seen (logged once all are in)."""

    # -- entry ------------------------------------------------------------------------

    def run(self) -> int:
        self._connect()
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            return self._loop()
        finally:
            signal.signal(signal.SIGTERM, previous)
            self._teardown()

    def _on_sigterm(self, signum: int, frame: types.FrameType | None) -> None:
        # Only flags here; the loop tells the monitor (no Ray calls in a handler).
        if not self._preempt.is_set():
            self._preempt_at = time.monotonic()
            self._preempt.set()

    def _connect(self) -> None:
        namespace = self.cfg.namespace or f"cairn-{self._env.get('CAIRN_JOB_UID') or os.getpid()}"
        if not ray.is_initialized():
            ray.init(
                address=self.cfg.address or self._env.get("RAY_ADDRESS") or "auto",
                namespace=namespace,
                log_to_driver=True,
            )
        self._namespace = namespace

    # -- the loop ---------------------------------------------------------------------

    def _loop(self) -> int:
        generation = self._reporter.initial_group() if self._reporter else 0
        try:
            self._place()
        except (ValueError, RuntimeError) as exc:
            # Too few Ray nodes or resources: the pods' problem, a gang restart's to fix.
            log.error("driver exits %d: %s", recovery.RETRYABLE_EXIT_CODE, exc)
            return recovery.RETRYABLE_EXIT_CODE
        # On the driver's own node: a lost worker node must not take the
        # commit fence and the newest committed step with it.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self._monitor = (
            ray.remote(monitor_mod.CheckpointMonitor)
            .options(name=monitor_mod.ACTOR_NAME, num_cpus=0, scheduling_strategy=here)
            .remote(group=generation)
        )
        while True:
            group = self._start_group(generation)
            end = self._watch(group)
            decision = recovery.decide(
                end,
                restarts_done=self.restarts,
                budget=self.cfg.max_inplace_restarts,
                preempting=self._preempt.is_set(),
            )
            log.info("group %d ended (%s): %s", generation, end.kind, decision.reason)
            if not decision.restart:
                self._kill_group(group)
                if decision.exit_code == 0:
                    log.info("training finished")
                else:
                    log.error("driver exits %d: %s", decision.exit_code, decision.reason)
                return decision.exit_code
            generation = self._restart_in_place(group, reason=decision.reason)
            if decision.replace_nodes or self._gone_nodes():
                why = self._replace_lost_nodes()
                if why:
                    log.error("driver exits %d: %s", recovery.RETRYABLE_EXIT_CODE, why)
                    return recovery.RETRYABLE_EXIT_CODE

    def _restart_in_place(self, group: Group, *, reason: str) -> int:
        """Fence the old group (monitor, then API), kill its actors; the next generation."""
        generation = group.generation + 1
        ray.get(self._monitor.advance.remote(generation), timeout=60)
        from_step = ray.get(self._monitor.last_committed.remote(), timeout=60)
        if self._reporter is not None:
            self._reporter.group_started(group=generation, reason=reason, from_step=from_step)
        self._kill_group(group)
        self.restarts += 1
        log.warning(
            "in-place restart %d/%d: group %d -> %d from step %s (%s)",
            self.restarts,
            self.cfg.max_inplace_restarts,
            group.generation,
            generation,
            from_step,
            reason,
        )
        return generation

    # -- placement and actors ---------------------------------------------------------

    def _alive_nodes(self) -> list[str]:
        nodes = ray.nodes()  # type: ignore[no-untyped-call]  # Ray's API is untyped here
        return [n["NodeID"] for n in nodes if n.get("Alive")]

    def _gone_nodes(self) -> list[str]:
        alive = set(self._alive_nodes())
        return [n for n in self._node_order if n not in alive]

    def _replace_lost_nodes(self) -> str:
        """Wait (bounded) until a new Ray node can take each lost node's place,
        then place the group anew; '' or why not (the driver then exits 75)."""
        previous = self._node_order
        started = time.monotonic()
        last_print = 0.0
        while True:
            alive = self._alive_nodes()
            try:
                order = placement.keep_positions(previous, alive)
                break
            except ValueError:
                pass  # a lost node's replacement has not joined yet
            waited = time.monotonic() - started
            if self._preempt.is_set():
                return "SIGTERM while waiting for a replacement Ray node"
            if waited >= NODE_REPLACEMENT_SECONDS:
                return (
                    f"only {len(alive)}/{self.cfg.nodes} Ray nodes alive after {waited:.0f}s: "
                    "no replacement for the lost node joined"
                )
            if waited - last_print >= PROGRESS_SECONDS:
                log.warning(
                    "waiting for a replacement Ray node: %d/%d alive after %.0fs (bound %.0fs)",
                    len(alive),
                    self.cfg.nodes,
                    waited,
                    NODE_REPLACEMENT_SECONDS,
                )
                last_print = waited
            time.sleep(NODE_POLL_SECONDS)
        self._drop_standbys()  # in the old placement's bundles
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None
        try:
            self._place(order)
        except (ValueError, RuntimeError) as exc:
            return f"could not place the group on the new nodes: {exc}"
        log.warning(
            "placed the group again after %.1fs: nodes %s (were %s)",
            time.monotonic() - started,
            self._node_order,
            previous,
        )
        return ""

    def _place(self, nodes: list[str] | None = None) -> None:
        """Reserve the bundles: on `nodes` in this order (a new placement after a
        node loss), else on the alive nodes, the driver's first."""
        if nodes is None:
            head = ray.get_runtime_context().get_node_id()
            nodes = placement.order_nodes(self._alive_nodes(), head=head)
        self._node_order = nodes[: self.cfg.nodes]
        self._layout = placement.layout(
            nodes,
            nodes=self.cfg.nodes,
            procs_per_node=self.cfg.procs_per_node,
            cpus=self.cfg.cpus_per_rank,
            gpus=self.cfg.gpus_per_rank,
        )
        self._pg = placement_group(
            self._layout.bundles,
            strategy="PACK",
            bundle_label_selector=self._layout.selectors,
        )
        try:
            ray.get(self._pg.ready(), timeout=self.cfg.start_timeout_seconds)
        except ray.exceptions.GetTimeoutError as exc:
            raise RuntimeError(
                f"placement group of {len(self._layout.bundles)} bundles "
                f"({self._layout.bundles[0]} each) not ready within "
                f"{self.cfg.start_timeout_seconds:.0f}s: not enough resources on the nodes"
            ) from exc

    def _actor(self, r: int, generation: int, *, env: dict[str, str] | None = None) -> typing.Any:
        """Rank r's actor of `generation` in its bundle; `env`: a standby (no
        resources of its own, that process env: `standby`)."""
        # Actor handles: Ray's stubs do not type the methods' `.remote`.
        actor_cls: typing.Any = ray.remote(rank.RankActor)
        options: dict[str, typing.Any] = {
            "num_cpus": self.cfg.cpus_per_rank,
            "num_gpus": self.cfg.gpus_per_rank,
            "max_restarts": 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=r
            ),
        }
        if env is not None:
            options.update(num_cpus=0, num_gpus=0, runtime_env={"env_vars": env})
        return actor_cls.options(**options).remote(rank=r, group=generation)

    def _start_standbys(self, group: Group) -> None:
        """The next group's actors, warming while this one trains (`standby.wanted`)."""
        if not standby.wanted(
            enabled=self.cfg.standby,
            gpus_per_rank=self.cfg.gpus_per_rank,
            restarts_done=self.restarts,
            budget=self.cfg.max_inplace_restarts,
            running_seconds=time.monotonic() - group.started,
            have=bool(self._standbys),
            new_node=group.new_node,
        ):
            return
        env = standby.process_env(self._forwarded_env(), cpus_per_rank=self.cfg.cpus_per_rank)
        nxt = group.generation + 1
        self._standbys = [self._actor(r, nxt, env=env) for r in range(len(group.actors))]
        self._standby_generation = nxt
        self._standby_warming = [a.prepare.remote(list(standby.PRELOAD)) for a in self._standbys]
        log.info("group %d: %d standby rank actors warming", nxt, len(self._standbys))

    def _note_standbys_ready(self) -> None:
        """Log once when every standby has its imports done (or failed them:
        a standby that cannot serve is found when it is needed)."""
        if not self._standby_warming:
            return
        done, _ = ray.wait(self._standby_warming, num_returns=len(self._standby_warming), timeout=0)
        if len(done) < len(self._standby_warming):
            return
        self._standby_warming = []
        try:
            warmed = ray.get(done, timeout=10)
        except Exception as exc:  # a standby died warming: _start_group replaces them
            log.warning("group %s standbys: warming failed: %s", self._standby_generation, exc)
            return
        log.info(
            "group %s: standby rank actors ready, pids %s (imports took %s s)",
            self._standby_generation,
            [w["pid"] for w in warmed],
            ", ".join(f"{w['seconds']:.1f}" for w in warmed),
        )

    def _take_standbys(self, generation: int) -> list[typing.Any]:
        """The standbys when they are this generation's; [] otherwise (dropped)."""
        if self._standby_generation != generation:
            self._drop_standbys()
            return []
        actors, self._standbys = self._standbys, []
        self._standby_warming = []
        return actors

    def _drop_standbys(self) -> None:
        actors, self._standbys = self._standbys, []
        self._standby_warming = []
        self._kill_actors(actors)

    def _start_group(self, generation: int) -> Group:
        layout = self._layout
        assert layout is not None
        actors = self._take_standbys(generation)
        wheres: list[dict[str, typing.Any]] = []
        if actors:
            try:
                wheres = ray.get(
                    [a.where.remote() for a in actors],
                    timeout=min(standby.ANSWER_SECONDS, self.cfg.start_timeout_seconds),
                )
                log.info("group %d: the standby rank actors take over", generation)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                log.warning(
                    "group %d: standby rank actors unusable (%s), starting new ones",
                    generation,
                    type(exc).__name__,
                )
                self._kill_actors(actors)
                actors = []
        if not actors:
            actors = [self._actor(r, generation) for r in range(len(layout.bundles))]
            wheres = ray.get(
                [a.where.remote() for a in actors], timeout=self.cfg.start_timeout_seconds
            )
        cuda = placement.cuda_env([w["gpus"] for w in wheres], node_of_rank=layout.node_of_rank)
        committed = ray.get(self._monitor.last_committed.remote(), timeout=60)
        base = recovery.group_resume_env(self._forwarded_env(), committed=committed)
        runs = []
        for r, actor in enumerate(actors):
            env = {
                **base,
                **placement.rank_env(
                    r, node_of_rank=layout.node_of_rank, procs_per_node=self.cfg.procs_per_node
                ),
                **cuda[r],
                "MASTER_ADDR": wheres[0]["ip"],
                "MASTER_PORT": str(wheres[0]["port"]),
                monitor_mod.MONITOR_ENV: monitor_mod.ACTOR_NAME,
                monitor_mod.NAMESPACE_ENV: self._namespace,
                monitor_mod.GROUP_ENV: str(generation),
            }
            if r != 0:
                env["CAIRN_REPORT_STATUS"] = ""  # status is rank 0's (unset in the actor)
            runs.append(actor.run.remote(self.cfg.target, self.cfg.argv, env, self._monitor))
        node_ids = [layout.selectors[r][placement.NODE_ID_LABEL] for r in range(len(actors))]
        group = Group(
            generation=generation,
            actors=actors,
            runs=runs,
            pids=[w["pid"] for w in wheres],
            node_ids=node_ids,
            started=time.monotonic(),
            new_node=bool(self.groups) and self.groups[-1].node_ids != node_ids,
        )
        self.groups.append(group)
        log.info("group %d started: %d ranks, pids %s", generation, len(actors), group.pids)
        return group

    def _forwarded_env(self) -> dict[str, str]:
        return {
            k: v
            for k, v in self._env.items()
            if (k.startswith(FORWARDED_PREFIXES) or k in FORWARDED_NAMES) and k not in DRIVER_ONLY
        }

    # -- watching ---------------------------------------------------------------------

    def _watch(self, group: Group) -> recovery.GroupEnd:
        codes: list[int | None] = [None] * len(group.runs)
        pending = {ref: r for r, ref in enumerate(group.runs)}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=WATCH_SECONDS)
            for ref in ready:
                r = pending.pop(ref)
                try:
                    codes[r] = int(ray.get(ref))
                except ray.exceptions.RayActorError as exc:
                    return self._actor_died(group, r, exc)
                except ray.exceptions.RayTaskError as exc:
                    # A peer's death often surfaces first as a collective's error
                    # here (gloo: connection reset): the death is the cause.
                    dead = self._dead_peer(pending)
                    if dead is not None:
                        return self._actor_died(group, *dead)
                    log.error("rank %d raised:\n%s", r, exc)
                    return recovery.GroupEnd(
                        kind="failed", rank=r, reason=f"rank {r} raised {type(exc).__name__}"
                    )
                final_saved = codes[r] == exitcodes.PREEMPTED and self._preempt.is_set()
                if codes[r] not in (0, None) and not final_saved and len(pending) > 0:
                    dead = self._dead_peer(pending)
                    if dead is not None:
                        return self._actor_died(group, *dead)
                    # The others wait in collectives for this rank forever. A rank
                    # that committed the final checkpoint (preempted) is not such a
                    # failure: rank 0 may still be uploading and reporting it, so
                    # the others are awaited, bounded by the grace (_preemption_tick).
                    return recovery.GroupEnd(kind="finished", codes=tuple(codes), rank=r)
            if self._preempt.is_set():
                timed_out = self._preemption_tick()
                if timed_out is not None:
                    return timed_out
            else:
                self._start_standbys(group)
                self._note_standbys_ready()
        return recovery.GroupEnd(kind="finished", codes=tuple(codes))

    def _dead_peer(self, pending: dict[typing.Any, int]) -> tuple[int, BaseException] | None:
        """A rank among `pending` whose actor died (waits `PEER_DEATH_GRACE_SECONDS`)."""
        if not pending:
            return None
        ready, _ = ray.wait(
            list(pending), num_returns=len(pending), timeout=PEER_DEATH_GRACE_SECONDS
        )
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                return pending[ref], exc
            except Exception as exc:  # another rank's failure: not a death
                log.debug("rank %d ended with %s", pending[ref], type(exc).__name__)
        return None

    def _actor_died(self, group: Group, r: int, exc: BaseException) -> recovery.GroupEnd:
        gone = self._gone_nodes()
        if gone:
            return recovery.GroupEnd(kind="node_lost", rank=r, reason=f"node(s) {gone} not alive")
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return recovery.GroupEnd(
            kind="rank_died", rank=r, reason=f"rank {r} actor died: {first_line[:200]}"
        )

    def _preemption_tick(self) -> recovery.GroupEnd | None:
        """Tell the ranks once; after the grace period, give up (they are killed)."""
        if not self._preempt_sent:
            self._preempt_sent = True
            log.warning("SIGTERM: asking every rank for the final checkpoint")
            try:  # the workers' pods got SIGTERM too: they keep Ray up for it
                internal_kv._internal_kv_put(
                    raynode_plan.PREEMPTING_KEY, b"1", namespace=raynode_plan.OUTCOME_NAMESPACE
                )
            except Exception as exc:  # they then stop after LONE_LOSS_SECONDS: visible
                log.error("could not tell the worker nodes the job is stopping: %s", exc)
            ray.get(self._monitor.request_preemption.remote(), timeout=60)
        grace = self.cfg.grace_seconds
        assert self._preempt_at is not None
        if grace is not None and time.monotonic() - self._preempt_at > grace:
            return recovery.GroupEnd(
                kind="timed_out",
                reason=f"the ranks did not finish the final checkpoint within {grace:.0f}s",
            )
        return None

    # -- teardown ---------------------------------------------------------------------

    @staticmethod
    def _kill_actors(actors: typing.Iterable[typing.Any]) -> None:
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # already dead
                log.debug("kill: %s", exc)

    def _kill_group(self, group: Group) -> None:
        self._kill_actors(group.actors)
        # Bounded wait until the actors are gone, so their bundles are free.
        deadline = time.monotonic() + KILL_WAIT_SECONDS
        for ref in group.runs:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                ray.get(ref, timeout=remaining)
            except ray.exceptions.GetTimeoutError:
                log.warning("a rank actor of group %d did not die in time", group.generation)
                break
            except Exception as exc:  # the expected ActorDiedError, or its return value
                log.debug("group %d rank ended: %s", group.generation, type(exc).__name__)

    def _teardown(self) -> None:
        self._drop_standbys()
        if self._monitor is not None:
            try:
                ray.kill(self._monitor, no_restart=True)
            except Exception as exc:
                log.debug("monitor kill: %s", exc)
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception as exc:
                log.debug("placement group removal: %s", exc)
