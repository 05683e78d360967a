"""EngineServer: the engine replica ("GPU actor"), one AsyncLLMEngine per replica.

Only plain data crosses its handle: prompt token ids and SamplingParams in, RequestOutput
deltas (one per engine step per request, coalesced when the caller lags) or one
EngineRejection out.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster import autoscale
from cluster.app_tables import Table
from cluster.batching import DecodeWindow
from cluster.control import ControlDecision, LatencySummary, PeriodLatencies, ReplicaStats
from cluster.engine_metrics import EngineMetrics
from engine.core.errors import InvalidParam
from engine.core.outputs import RequestOutput, SchedulerStats
from engine.core.policy import ExternalLimits
from engine.core.request import Resume
from engine.core.sampling_params import SamplingParams
from engine.core.sequence_kv import SequenceMoved
from serve_app.config import AppArgs
from serve_app.observability import replica_logs, tracing
from serve_app.replica.health import health_problem
from serve_app.replica.sequence_moves import MOVED_HOLD_S, SequenceMoves, moved_delta
from serve_app.transport.delta_channel import ChannelledFirst, Outboxes, channel_name
from serve_app.transport.delta_link import LinkListener
from serve_app.transport.engine_rejection import EngineRejection
from serve_app.transport.link_call import LinkCallServer
from serve_app.transport.moved_sequence import MovedOut

logger = logging.getLogger(__name__)

# The most keys of cached blocks a replica publishes for KV-aware routing (8 bytes each).
_PUBLISHED_BLOCKS = 8192


@serve.deployment(name="EngineServer")
class EngineServer:
    def __init__(
        self,
        args: dict[str, Any] | AppArgs,
        controller: DeploymentHandle | None = None,
        metrics_board: Table | None = None,
        prefill_only: bool = False,
    ) -> None:
        """`prefill_only`: a prefill pool's replica (`disaggregation`): each sequence moves
        on, with its KV, once its first token is out."""
        from engine.async_engine import AsyncLLMEngine
        from engine.llm_engine import LLMEngine

        replica_logs.into_replica_log()
        self.args = AppArgs.model_validate(args)
        # An emulated engine reads the tokenizer only.
        self.args = self.args.with_local_model(weights=self.args.engine.device != "emulated")
        self.capacity = self.args.replica_capacity
        config = self.args.engine.engine_config(self.args.model)
        start = config.scheduler.limits()
        self.controller = controller
        if controller is not None:  # the controller runs the batching policy
            policy = self.external = ExternalLimits(start)
        else:  # the engine runs it itself, before every step
            policy = self.args.batching.make(start.max_num_seqs)
        self.engine = AsyncLLMEngine.built(lambda: LLMEngine(config, policy=policy))
        runner = self.engine.engine.runner
        kv_dtype = config.cache.kv_cache_dtype
        self._replica_info = {  # what ReplicaStats reports of the replica's build, unchanging
            "attention_kernels": runner.backend.name,
            "attention_kernels_reason": runner.backend_reason,
            "cache_dtype": config.dtype if kv_dtype == "auto" else kv_dtype,
            "kv_block_size": config.cache.block_size,
            "self_check_verdicts": tuple((c.part, c.result, c.reason) for c in runner.self_check),
        }
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id if context else "local"
        self.num_rejected_total = 0
        self.latencies = PeriodLatencies()
        self.metrics = EngineMetrics()
        self.tracer = tracing.make_tracer(self.args.tracing, "engine")
        self.decision = ControlDecision(start)
        self.outboxes = Outboxes()
        self.moves = SequenceMoves(self.engine, self.replica_id, self.args.kv_transport)
        on_link = functools.partial(self.generate, on_link=True)
        self.link_calls = LinkCallServer(on_link, self.moves.drain.counted)
        self.links = LinkListener(
            ray.util.get_node_ip_address(), self.outboxes.lost, self.link_calls.on_message
        )
        self.num_reports_ok = 0
        self.num_report_failures = 0
        self._last_reported: SchedulerStats | None = None
        self.prefill_only = prefill_only
        self.num_handed_on = 0  # sequences a prefill replica moved on after their first token
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self.outboxes.watch_owners())]
        if self.args.delta_channels and self.args.delta_links:
            self._tasks.append(loop.create_task(self.links.start()))
        if self.args.health.move_on_stop and self.moves.drain.readable:
            self._tasks.append(loop.create_task(self.moves.move_on_stop()))
        if controller is not None:
            self._tasks.append(loop.create_task(self._report_loop()))
        if metrics_board is not None:
            self._tasks.append(loop.create_task(self._metrics_loop(metrics_board)))

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        trace_context: dict[str, str] | None = None,
        priority: int = 0,
        channel: str | None = None,
        replica_id: str | None = None,
        resume: Resume | None = None,
        caller: str | None = None,
        lora: tuple[str, str] | None = None,
        on_link: bool = False,
    ) -> AsyncIterator[RequestOutput | ChannelledFirst | EngineRejection]:
        """One request: its first delta (a ChannelledFirst when `channel` is given, whose later
        deltas then go through that channel's subscription), then one delta per engine step
        (coalesced by stream_interval_s), or one EngineRejection.
        `replica_id` is read by the ingress's request router, which sends the call to that
        replica (a request's further sequences, to the replica holding its prompt's KV
        blocks). `resume`: the request goes on from where it stopped at a replica that died.
        `caller`: the ingress replica's actor name when there is no channel (the request ends
        if that actor dies). `lora`: the LoRA adapter (name, directory) the request runs with,
        loaded here at first use. `on_link`: the call came on a delta link (link_call), where
        only plain data goes back."""
        if replica_id is not None and replica_id != self.replica_id:
            # Serve's router may hand a choice made for another request to this one.
            yield EngineRejection("elsewhere", f"sent to {self.replica_id}, not {replica_id}")
            return
        if self.moves.stopping:  # Serve is stopping it: its sequences are moving out too
            yield EngineRejection("stopping", f"engine replica {self.replica_id} is stopping")
            return
        if self.engine.num_streams >= self.capacity:
            self.num_rejected_total += 1
            yield EngineRejection(
                "overloaded",
                f"engine replica is full ({self.capacity} requests: max_num_seqs + "
                "max_queued_requests); retry later",
            )
            return
        started = time.monotonic()
        attributes = {"dynabatch.request_id": request_id, "dynabatch.replica": self.replica_id}
        attributes |= {"dynabatch.prompt_tokens": len(prompt_token_ids)}
        attributes |= {"dynabatch.max_tokens": params.max_tokens or 0}
        parent = tracing.extract(trace_context) if self.tracer is not None else None
        with tracing.request_span(
            self.tracer, "engine.generate", attributes, parent=parent
        ) as span:
            span.event("queued", timestamp=tracing.wall_ns_of(started))
            try:
                resume = await self.moves.with_kv(resume)
                stream = self.engine.generate(
                    prompt_token_ids, params, request_id, priority, resume, lora
                )
                first = await anext(stream)
            except InvalidParam as exc:  # bad input: names the field; everyone else goes on
                span.set({"dynabatch.rejected": str(exc)})
                yield EngineRejection("invalid_request", str(exc), exc.param)
                return
            except SequenceMoved:  # moved out before its first token: sent anew elsewhere
                yield EngineRejection("stopping", f"engine replica {self.replica_id} is stopping")
                return
            except StopAsyncIteration:
                return
            last_sent = time.monotonic()
            self.latencies.add(self.latencies.ttft, last_sent - started)
            self.metrics.ttft.observe(last_sent - started)
            # Steps that ran while the event loop was busy arrive merged: the first delta's
            # later tokens came with the first one.
            self.metrics.chunk(0.0, len(first.new_token_ids) - 1)
            span.event("first_token")
            final = first
            # A request on its own call is watched through an outbox that carries nothing.
            watched = channel or (channel_name(caller, "calls") if caller else None)
            outbox = self.outboxes.open(watched) if watched is not None else None
            try:
                if channel is None:
                    yield first
                else:
                    yield ChannelledFirst(first, self.replica_id, self.links.address)
                if self.prefill_only and not first.finished:
                    # Its prompt is computed: it decodes at a decode replica, with the KV.
                    self.num_handed_on += await self.engine.move_out([request_id])
                held: RequestOutput | None = None
                try:
                    async for out in stream:
                        if outbox is not None and outbox.owner_gone:
                            if channel is not None:  # its delta link broke: it resumes
                                yield EngineRejection("channel_lost", "its delta link broke")
                            break  # nobody will read it here: the request is aborted below
                        held = out if held is None else held.merge(out)
                        final = out
                        now = time.monotonic()
                        if out.finished or now - last_sent >= self.args.stream_interval_s:
                            if k := len(held.new_token_ids):
                                self.latencies.add(self.latencies.itl, (now - last_sent) / k)
                                self.metrics.chunk(now - last_sent, k)
                            if channel is None:
                                yield held
                            else:
                                outbox.put(held)
                            held, last_sent = None, now
                except SequenceMoved as moved:  # this replica is stopping: it goes on elsewhere
                    final = moved_delta(held, final)
                    if channel is None:
                        yield final
                    else:
                        outbox.put(final)
                    kv = moved.kv
                    sent = None if kv is None else await self.moves.send(kv, plain=on_link)
                    try:
                        yield MovedOut(sent)
                        # Held (with the KV) until the ingress has resumed it and cancels
                        # this call.
                        await asyncio.sleep(MOVED_HOLD_S)
                    finally:
                        self.moves.sent(sent)
            finally:  # also when the caller went away (the engine request was aborted)
                if outbox is not None:
                    self.outboxes.close(watched, outbox)
                reason = (final.finish_reason if final.finished else None) or "abort"
                elapsed = time.monotonic() - started
                self.metrics.finished(
                    final.num_prompt_tokens,
                    final.num_output_tokens,
                    reason,
                    elapsed,
                    final.queue_time_s,
                )
                tracing.record_engine_life(span, final, reason, started)

    async def subscribe(
        self, channel: str, replica_id: str | None = None, link: bool = False
    ) -> AsyncIterator[bytes]:
        """The deltas of `channel`'s requests at this replica, one `packed` batch per engine step;
        ends once the channel has been idle a while (serve_app.transport.delta_channel). With
        `link`, the batches go on the channel's delta link (where it has one) and this call
        only lasts as long. `replica_id` is read by the ingress's request router, which sends
        the call to that replica."""
        if replica_id is not None and replica_id != self.replica_id:
            return  # routed here by mistake: the ingress subscribes again
        sink = self.links.sinks.get(channel) if link else None
        async for batch in self.outboxes.subscribe(channel, sink):
            yield batch

    async def stats(self, replica_id: str | None = None) -> dict[str, Any]:
        """This replica's scheduler stats plus stream bookkeeping (tests, /metrics).
        `replica_id` asks the ingress's request router for that replica (it may still land
        elsewhere: the answer names its replica)."""
        stats = asdict(self.engine.engine.stats())
        stats.update(
            replica_id=self.replica_id,
            pid=os.getpid(),
            num_streams=self.engine.num_streams,
            capacity=self.capacity,
            num_rejected_total=self.num_rejected_total,
            step_seconds_total=self.engine.step_seconds_total,
            controlled=self.controller is not None,
            prefill_only=self.prefill_only,
            num_handed_on=self.num_handed_on,
            decision=asdict(self.decision),
            num_reports_ok=self.num_reports_ok,
            num_report_failures=self.num_report_failures,
            loras=self._held_loras(),
            delta_link_address=self.links.address,
            link_calls_total=self.link_calls.num_calls,
            **self.moves.stats(),
            **self.outboxes.stats(),
        )
        return stats

    # ------------------------------------------------------- reports and metrics pushes
    def replica_stats(self, take_latencies: bool = True) -> ReplicaStats:
        """This period's report. The decode window covers the time since the last report the
        controller answered (a lost report's decode steps go into the next one: a short burst
        may give a single window); the latencies cover the time since the last report built
        (`take_latencies=False`, for a metrics push, leaves them to the next report)."""
        sched = self.engine.engine.stats()
        ttft, itl = self.latencies.take() if take_latencies else (LatencySummary(),) * 2
        return ReplicaStats(
            replica_id=self.replica_id,
            scheduler=sched,
            num_streams=self.engine.num_streams,
            capacity=self.capacity,
            num_rejected_total=self.num_rejected_total,
            decode=DecodeWindow.between(self._last_reported, sched),
            ttft=ttft,
            itl=itl,
            metrics=self.metrics.snapshot(
                self.engine.engine.scheduler.steps.batch_size_histogram.snapshot()
            ),
            **self._replica_info,
        )

    async def _report_loop(self) -> None:
        """Report, apply the answer; on any failure keep the last limits and try next period."""
        control = self.args.controller
        assert self.controller is not None
        while True:
            await asyncio.sleep(control.report_interval_s)
            report = self.replica_stats()
            try:
                call = self.controller.report.remote(report)
                decision = await asyncio.wait_for(call, control.report_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # controller dead, restarting or slow: keep serving
                self.num_report_failures += 1
                logger.warning("controller report failed (keeping last limits): %r", exc)
                continue
            self._last_reported = report.scheduler
            self.decision = decision
            self.external.set(decision.limits)
            self.num_reports_ok += 1

    async def _metrics_loop(self, board: Table) -> None:
        """Push this replica's metrics to the board every report interval, controller or not."""
        control, name = self.args.controller, self.args.model_name
        while True:
            await asyncio.sleep(control.report_interval_s)
            try:
                stats = self.replica_stats(take_latencies=False)
                call = board.push.remote(name, stats, self.decision)
                await asyncio.wait_for(call, control.report_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the board restarting: the next push refills it
                logger.warning("metrics push failed: %r", exc)

    async def record_routing_stats(self) -> dict[str, Any]:
        """Read by the ingress's request router (serve_app.transport.router.LoadAwareRouter),
        every second: with `routing.kv_aware`, the keys of the prompt blocks this replica's
        prefix cache holds too (bounded)."""
        stats = {
            "num_streams": self.engine.num_streams,
            "capacity": self.capacity,
            "routing_weight": self.decision.routing_weight,
            "loras": self._held_loras(),
            # Where a moved sequence's KV fits (free blocks, cached ones reclaimable).
            "kv_free_blocks": self.engine.engine.scheduler.kv_cache.num_free_blocks,
        }
        if self.args.routing.kv_aware:
            held = self.engine.between_steps(lambda e: e.cached_blocks(_PUBLISHED_BLOCKS))
            stats["kv_blocks"] = await held
            stats["kv_cache_fill"] = self.engine.engine.scheduler.kv_cache.pool.cache_fill()
        return stats

    def _held_loras(self) -> list[str]:  # the LoRA adapters in this replica's slots
        slots = self.engine.engine.scheduler.loras
        return slots.held_names() if slots is not None else []

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Pushed to Serve's autoscaler; read by cluster.autoscale.QueueDepthAutoscaler."""
        sched = self.engine.engine.stats()
        return {
            autoscale.METRIC_WAITING: float(max(self.engine.num_streams - sched.num_running, 0)),
            autoscale.METRIC_RUNNING: float(sched.num_running),
            autoscale.METRIC_KV_USAGE: float(sched.kv_usage),
            autoscale.METRIC_MAX_NUM_SEQS: float(sched.max_num_seqs),
        }

    async def check_health(self) -> None:
        problem = health_problem(self.engine, self.args.health)
        if problem is not None:
            raise RuntimeError(problem)

    async def __del__(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.moves.link.close()
        self.links.close()
        await self.engine.shutdown()
