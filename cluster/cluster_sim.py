"""Many engine replicas on one timeline, a least-loaded router, and the autoscaling rule.

Each replica is a SimReplica (the real scheduler, a priced runner, its own virtual clock).
Events run in time order: arrivals (routed to the ready replica with the fewest requests),
decision ticks (each ready replica's load is sampled, averaged over `look_back_s` as Serve
does, and QueueDepthRule decides the count), and replica steps. A new replica serves
`startup_delay_s` after the decision; a removed one first cancels a replica still starting,
else drains the least loaded ready one (no new requests; it stops when empty, as Serve's
graceful shutdown does), or with `migration` moves its sequences with their KV to the others
(each arrives after its transfer and goes on where it stood) and stops once they are sent.
Replica-hours count every replica from its start to its stop.

With `controller_interval_s` set, the batching policy runs where the deployed app runs it:
in a ClusterControl fed a report from every replica each period (cluster/control.py), and
arrivals are routed by load over the controller's routing weights, as LoadAwareRouter does.

With a Retuner (self-tuning: cluster/tune/auto_tuner.py), every `period_s` it sees the
requests that arrived in its last `window_s` and the records of those that arrived in the
last period, and may answer new settings: the controller runs them from its next round (as
the deployed controller does with settings applied live) and the autoscaling rule takes
its new config at once.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from typing import Protocol

from cluster.autoscale import AutoscaleConfig, QueueDepthRule, ReplicaLoad
from cluster.batching import AnyPolicy, DecodeWindow, make_policy
from cluster.control import ClusterControl, ReplicaStats, weighted_load
from cluster.conversations import prompt_tokens
from cluster.kv_transfer import KVTransfer
from cluster.prefix_routing import PrefixRouting, affinity_ranked, kv_ranked, prefix_key
from cluster.request_records import RequestRecord, summarize_records
from cluster.shared_prefixes import SharedPrefixes
from cluster.sim_config import SimConfig
from cluster.sim_replica import MovedSequence, SimReplica
from cluster.simulator import after, gc_paused
from cluster.workload import SimRequest
from engine.core.block_hashes import prompt_block_hashes
from engine.core.outputs import SchedulerStats


@dataclass(frozen=True)
class ClusterSimConfig:
    replica: SimConfig
    autoscale: AutoscaleConfig | None = None  # None: a fixed count of initial_replicas
    initial_replicas: int = 1
    startup_delay_s: float = 60.0
    decision_interval_s: float = 1.0
    look_back_s: float = 5.0
    # Set: the batching policy runs in a ClusterControl at this period (as the deployed
    # controller does), and routing divides load by its routing weights. None: each replica
    # runs its policy before every step.
    controller_interval_s: float | None = None
    # Set: arrivals go by their prompts' prefixes (cluster/prefix_routing.py), as the app's
    # router sends them with `routing.prefix_affinity` or `routing.kv_aware`; the replicas
    # need prefix caching on (SimConfig.cache) for it to pay. None: the least loaded.
    prefix_routing: PrefixRouting | None = None
    # Set: a replica removed by a scale-down moves its sequences, with their KV, to the
    # other replicas at this cost, and stops once they are sent, as the app's engine
    # replicas do on drain (`health.move_on_stop`). None: it finishes them first.
    migration: KVTransfer | None = None

    def __post_init__(self) -> None:
        if self.initial_replicas < 1 or self.startup_delay_s < 0 or self.decision_interval_s <= 0:
            raise ValueError("need initial_replicas >= 1, startup_delay_s >= 0, interval > 0")


@dataclass(frozen=True)
class Retune:
    """New settings for a running fleet: its batching policy, token budget, scaling rule."""

    make_policy: Callable[[], AnyPolicy]
    max_num_batched_tokens: int
    autoscale: AutoscaleConfig | None


class Retuner(Protocol):
    period_s: float
    window_s: float

    def retune(
        self, now: float, window: list[SimRequest], measured: list[RequestRecord]
    ) -> Retune | None:
        """Called every period_s: `window` the requests that arrived in [now - window_s,
        now), `measured` the records of those that arrived in [now - period_s, now)."""
        ...


@dataclass
class _Member:
    replica: SimReplica
    created_s: float
    ready_s: float
    draining: bool = False
    stopped_s: float | None = None
    samples: deque[tuple[float, ReplicaLoad]] = field(default_factory=deque)
    name: str = ""
    routing_weight: float = 1.0
    last_reported: SchedulerStats | None = None

    def ready(self, t: float) -> bool:
        return self.stopped_s is None and self.ready_s <= t

    def load(self, t: float, look_back_s: float) -> ReplicaLoad:
        stats = self.replica.scheduler.stats()
        now = ReplicaLoad(
            waiting=stats.num_waiting,
            running=stats.num_running,
            kv_usage=stats.kv_usage,
            max_num_seqs=stats.max_num_seqs,
        )
        self.samples.append((t, now))
        while self.samples and self.samples[0][0] < t - look_back_s:
            self.samples.popleft()
        n = len(self.samples)
        return ReplicaLoad(
            waiting=sum(s.waiting for _, s in self.samples) / n,
            running=sum(s.running for _, s in self.samples) / n,
            kv_usage=sum(s.kv_usage for _, s in self.samples) / n,
            max_num_seqs=sum(s.max_num_seqs for _, s in self.samples) / n,
        )


@dataclass
class ClusterSimResult:
    config: ClusterSimConfig
    records: dict[str, RequestRecord]
    duration_s: float
    replica_seconds: float
    # (time, replicas serving, replicas starting, replicas draining) after every change.
    replica_series: list[tuple[float, int, int, int]]
    scale_events: list[tuple[float, int, int]]  # (time, target before, target after)
    control_view: dict | None = None  # the ClusterControl's view at the end (controller runs)
    # Prompt tokens looked up in the replicas' prefix caches, and found (prefix caching on).
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_moved: int = 0  # sequences moved off replicas being removed (migration)
    moved_seconds: float = 0.0  # their transfers', summed

    def summary(self) -> dict[str, float]:
        ups = sum(1 for _, a, b in self.scale_events if b > a)
        out = summarize_records(self.records, self.config.replica.slo, self.duration_s) | {
            "replica_hours": self.replica_seconds / 3600.0,
            "mean_replicas": self.replica_seconds / max(self.duration_s, 1e-9),
            "max_replicas": max((s + st for _, s, st, _ in self.replica_series), default=0),
            "scale_ups": ups,
            "scale_downs": len(self.scale_events) - ups,
        }
        if self.prefix_queries:
            out["prefix_hit_rate"] = self.prefix_hits / self.prefix_queries
        if self.config.migration is not None:
            out["moved"] = self.num_moved
            out["move_ms_mean"] = 1e3 * self.moved_seconds / max(self.num_moved, 1)
        return out


class ClusterSimulator:
    def __init__(self, config: ClusterSimConfig) -> None:
        self.config = config

    def run(
        self, trace: list[SimRequest], max_sim_s: float = math.inf, retuner: Retuner | None = None
    ) -> ClusterSimResult:
        if retuner is not None and self.config.controller_interval_s is None:
            raise ValueError("a retuner needs controller_interval_s (it retunes the controller)")
        with gc_paused():
            return self._run(trace, max_sim_s, retuner)

    def _run(
        self, trace: list[SimRequest], max_sim_s: float, retuner: Retuner | None
    ) -> ClusterSimResult:
        c = self.config
        records: dict[str, RequestRecord] = {}
        controlled = c.controller_interval_s is not None
        members: list[_Member] = []

        def spawn(t: float, ready_s: float) -> None:
            replica = SimReplica(c.replica, records, start_s=ready_s, controlled=controlled)
            members.append(_Member(replica, t, ready_s, name=f"replica-{len(members)}"))

        for _ in range(c.initial_replicas):
            spawn(0.0, 0.0)
        rule = QueueDepthRule(c.autoscale) if c.autoscale is not None else None
        r = c.replica
        control = (
            ClusterControl(
                lambda: make_policy(r.policy, r.scheduler.max_num_seqs, r.memory_aware, r.sla)
            )
            if controlled
            else None
        )
        next_control = 0.0
        ordered = sorted(trace, key=lambda r: r.arrival_s)
        pending = deque(ordered)
        arrivals = [r.arrival_s for r in ordered]
        next_tune = retuner.period_s if retuner is not None else math.inf
        series: list[tuple[float, int, int, int]] = []
        events: list[tuple[float, int, int]] = []
        shared = SharedPrefixes()
        next_tick = 0.0
        t = 0.0

        def record_series(now: float) -> None:
            live = [m for m in members if m.stopped_s is None]
            serving = sum(1 for m in live if m.ready(now) and not m.draining)
            starting = sum(1 for m in live if m.ready_s > now)
            draining = sum(1 for m in live if m.draining)
            if not series or series[-1][1:] != (serving, starting, draining):
                series.append((now, serving, starting, draining))

        # Sequences on their way from a replica being removed: (ready, order, the sequence).
        in_flight: list[tuple[float, int, MovedSequence]] = []
        moves = {"count": 0, "seconds": 0.0}
        kv_bytes_per_token = c.replica.model.kv_bytes_per_token

        def migrate(victim: _Member, now: float) -> None:
            """Move the victim's sequences out; it stops once the last is sent."""
            assert c.migration is not None
            sent = max(now, victim.replica.clock.now())
            last = sent
            for seq in victim.replica.move_out():
                seconds = c.migration.seconds(seq.num_kv_tokens, kv_bytes_per_token)
                moves["count"] += 1
                moves["seconds"] += seconds
                heapq.heappush(in_flight, (sent + seconds, moves["count"], seq))
                last = max(last, sent + seconds)
            victim.stopped_s = last

        record_series(0.0)
        live = list(members)  # not stopped (a stopped replica is never busy), in spawn order
        while True:
            busy = [m for m in live if m.replica.busy]
            if not pending and not busy and not in_flight:
                break
            t_moved = in_flight[0][0] if in_flight else math.inf
            t_arrival = min(pending[0].arrival_s if pending else math.inf, t_moved)
            stepper = min(busy, key=lambda m: m.replica.clock.now(), default=None)
            t_step = stepper.replica.clock.now() if stepper is not None else math.inf
            t_tick = next_tick if rule is not None else math.inf
            t_control = next_control if control is not None else math.inf
            t = min(t_arrival, t_tick, t_step, t_control, next_tune)
            if t > max_sim_s:
                break
            if t_arrival <= min(t_tick, t_step, t_control, next_tune):
                candidates = [m for m in live if m.ready(t) and not m.draining]
                if t_moved <= t_arrival:  # a moved sequence arrives: to the least loaded
                    _, _, seq = heapq.heappop(in_flight)
                    target = min(candidates, key=_load)
                    target.replica.add(seq.req, at_s=t, moved=seq)
                    continue
                req = pending.popleft()
                target, prompt = self._route(req, candidates, shared, t)
                target.replica.add(req, prompt=prompt)
            elif next_tune <= min(t_tick, t_step, t_control):
                assert retuner is not None and control is not None
                next_tune += retuner.period_s
                start = bisect_left(arrivals, t - retuner.window_s)
                window = ordered[start : bisect_left(arrivals, t)]
                since = t - retuner.period_s
                measured = [rec for rec in records.values() if since <= rec.arrival_s < t]
                retune = retuner.retune(t, window, measured)
                if retune is not None:
                    control.retune(retune.make_policy, retune.max_num_batched_tokens)
                    if rule is not None and retune.autoscale is not None:
                        rule.config = retune.autoscale
            elif t_control <= min(t_tick, t_step):
                assert control is not None and c.controller_interval_s is not None
                next_control += c.controller_interval_s
                self._control(control, members, t)
            elif t_tick <= t_step:
                assert rule is not None
                next_tick += c.decision_interval_s
                self._decide(rule, members, t, events, spawn, migrate if c.migration else None)
                live = [m for m in members if m.stopped_s is None]
                record_series(t)
            else:
                assert stepper is not None
                # Its steps before the next event that could change its batch, in one go.
                until = min(t_arrival, t_tick, t_control, next_tune, after(max_sim_s))
                stepper.replica.advance(until)
                if stepper.draining and not stepper.replica.busy:
                    stepper.stopped_s = stepper.replica.clock.now()
                    live.remove(stepper)
                    record_series(stepper.stopped_s)
        end = t if math.isfinite(t) else 0.0
        end = max([end] + [m.replica.clock.now() for m in members if m.stopped_s is None])
        replica_seconds = sum(
            max((m.stopped_s if m.stopped_s is not None else end) - m.created_s, 0.0)
            for m in members
        )
        record_series(end)
        view = control.view(end) if control is not None else None
        found = [m.replica.scheduler.stats() for m in members]
        queries = sum(f.prefix_cache_queries for f in found)
        hits = sum(f.prefix_cache_hits for f in found)
        return ClusterSimResult(
            c,
            records,
            end,
            replica_seconds,
            series,
            events,
            view,
            queries,
            hits,
            moves["count"],
            moves["seconds"],
        )

    def _route(
        self, req: SimRequest, candidates: list[_Member], shared: SharedPrefixes, t: float
    ) -> tuple[_Member, list[int] | None]:
        """The replica an arrival goes to, and its prompt's token ids where they were made."""

        routing = self.config.prefix_routing
        if routing is None or len(candidates) == 1:
            return min(candidates, key=_load), None
        prompt = prompt_tokens(req)
        ranked = sorted(candidates, key=_load)
        if routing.kv_aware:
            block_size = self.config.replica.cache.block_size
            keys = prompt_block_hashes(prompt, block_size)
            common = shared.observe(prompt, keys, block_size, t, len(ranked))
            ranks = kv_ranked(
                ranked, keys, _load, _held_blocks, routing.kv_weight, _cache_fill, common
            )
        else:
            key = prefix_key(prompt, routing.prefix_tokens)
            ranks = affinity_ranked(ranked, _name, key, _load, routing.max_imbalance)
        return ranks[0][0], prompt

    @staticmethod
    def _control(control: ClusterControl, members: list[_Member], t: float) -> None:
        """One round of reports, as the deployed replicas send them every period."""
        for m in members:
            if not m.ready(t) or m.replica.external is None:
                continue
            stats = m.replica.scheduler.stats()
            report = ReplicaStats(
                replica_id=m.name,
                scheduler=stats,
                num_streams=m.replica.num_requests,
                capacity=1 << 30,
                decode=DecodeWindow.between(m.last_reported, stats),
            )
            m.last_reported = stats
            decision = control.report(report, t)
            m.replica.external.set(decision.limits)
            m.routing_weight = decision.routing_weight

    def _decide(
        self,
        rule: QueueDepthRule,
        members: list[_Member],
        t: float,
        events: list[tuple[float, int, int]],
        spawn: Callable[[float, float], None],
        migrate: Callable[[_Member, float], None] | None = None,
    ) -> None:
        c = self.config
        active = [m for m in members if m.stopped_s is None and not m.draining]
        loads = [m.load(t, c.look_back_s) for m in active if m.ready(t)]
        current = len(active)
        desired = rule.desired(t, current, loads)
        if desired > current:
            for _ in range(desired - current):
                spawn(t, t + c.startup_delay_s)
        elif desired < current:
            for _ in range(current - desired):
                starting = [m for m in active if m.ready_s > t and m.stopped_s is None]
                if starting:  # cancel the newest replica that is still starting
                    victim = max(starting, key=lambda m: m.created_s)
                    victim.stopped_s = t
                    active.remove(victim)
                    continue
                serving = [m for m in active if m.ready(t)]
                if len(serving) <= 1:
                    break
                victim = min(serving, key=lambda m: m.replica.num_requests)
                victim.draining = True
                active.remove(victim)
                if migrate is not None and victim.replica.busy:
                    migrate(victim, t)
                elif not victim.replica.busy:
                    victim.stopped_s = t
        if desired != current:
            events.append((t, current, desired))


def _load(member: _Member) -> float:
    """What the router weighs: outstanding requests over the controller's routing weight."""
    return weighted_load(member.replica.num_requests, member.routing_weight)


def _cache_fill(member: _Member) -> float:
    return member.replica.scheduler.kv_cache.pool.cache_fill()


def _name(member: _Member) -> str:
    return member.name


def _held_blocks(member: _Member) -> Container[int]:
    """The keys of the blocks its prefix cache holds: what the app's replicas publish (the
    simulator's view is exact and current; the app's router sees it a second late)."""
    return member.replica.scheduler.kv_cache.pool.cached
