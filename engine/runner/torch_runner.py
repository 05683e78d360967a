"""The real runner: KV cache tensors, packed inputs (no padding), forward, sampling."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

import torch
from torch.distributed import Store

from engine.attention.base import FP8_KV, BatchLayout
from engine.attention.registry import AttentionShape, get_attention_backend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.core.config import EngineConfig
from engine.core.outputs import (
    ModelRunnerOutput,
    PendingStep,
    ReadyStep,
    ScheduledRequest,
    SchedulerOutput,
)
from engine.core.sequence_kv import SequenceKV
from engine.cpu.host_memory import keep_freed_memory_in_heap, weights_onto_huge_pages
from engine.cpu.packed_weights import weight_bytes
from engine.grammar_bank import GrammarBank
from engine.lora.slot_weights import LoRASlotWeights
from engine.model.collectives import TensorParallel
from engine.model.loader import DecoderSpec, read_spec, resolve_max_model_len
from engine.model.sharding import Shard, shard_spec
from engine.model.sparse_moe import use_moe_kernels
from engine.model.weight_loader import load_decoder
from engine.quant.kv_scales import measure_missing_kv_scales
from engine.quant.linear import use_kernels
from engine.runner.continued_inputs import previous_tokens, step_known_inputs
from engine.runner.decode_graphs import DecodeGraphs, graph_query_rows
from engine.runner.device_model import DeviceModel
from engine.runner.engine_threads import set_engine_threads
from engine.runner.gpu_self_check import PartCheck, check_graphs, check_kernels, fell_back
from engine.runner.kv_budget import num_cache_blocks, warn_if_short
from engine.runner.kv_swap import swap_blocks
from engine.runner.kv_tensors import device_caches, host_caches, kv_dtype
from engine.runner.kv_transfer import on_host, read_kv, refusal, write_kv
from engine.runner.launched_step import DeviceClock, LaunchedStep
from engine.runner.packed_inputs import packed_inputs
from engine.runner.pooler import Pooler, has_pooling
from engine.runner.rank_bundles import DEVICE_INDEX_ENV
from engine.runner.tensor_parallel import GatherKV, RankedStep, RankWorkers
from engine.sampling.logprobs import PromptLogprobs
from engine.sampling.sampler import Sampler
from engine.sampling.verification import rejection_verified, verification_rows

logger = logging.getLogger(__name__)


class TorchModelRunner:
    def __init__(
        self, config: EngineConfig, shard: Shard | None = None, store: Store | None = None
    ) -> None:
        """Rank 0 of the engine (no `shard`): with tensor_parallel_size N > 1 it starts ranks
        1..N-1, which build their runners with their shard and rank 0's store."""
        full_spec = read_spec(config.model)
        max_len = resolve_max_model_len(config.scheduler.max_model_len, full_spec)
        world = config.tensor_parallel_size
        # This rank's shape (the whole model at N = 1): a model N does not divide fails here.
        spec = shard_spec(full_spec, world, config.expert_parallel)
        set_engine_threads(config.num_threads, config.device, world)
        if config.device == "cpu":
            keep_freed_memory_in_heap()
        self.spec = spec
        self.device = torch.device(config.device)
        if world > 1 and self.device.type == "cuda":
            # All ranks' GPUs visible (ranks as the replica's subprocesses): rank r's is r;
            # a rank in a placement-group bundle sees its bundle's one GPU.
            index = os.environ.get(DEVICE_INDEX_ENV, shard.rank if shard else 0)
            self.device = torch.device("cuda", int(index))
            torch.cuda.set_device(self.device)
        self.dtype = getattr(torch, config.dtype)
        self.kv_dtype = kv_dtype(config.cache.kv_cache_dtype, self.dtype)
        self._max_model_len = max_len
        # Chosen before the weights load: a backend that cannot run the model fails fast.
        shape = AttentionShape(
            self.device.type,
            config.dtype,
            spec.head_dim,
            config.cache.block_size,
            config.cache.kv_cache_dtype,
            spec.attention_sinks or spec.window_layers is not None,
        )
        self.backend, self.backend_reason = get_attention_backend(config.attention_backend, shape)
        self.workers: RankWorkers | None = None
        self.tp: TensorParallel | None = None
        if world > 1 and shard is None:
            shard = Shard(0, world, config.expert_parallel)
            self.workers = RankWorkers(config, world)
            store = self.workers.store
        try:
            if world > 1:
                self.tp = TensorParallel(shard, store, self.device)
            self._build(config, full_spec, max_len)
        except BaseException:
            self.close(kill=True)  # ranks waiting for this one would wait in vain
            raise

    def _build(self, config: EngineConfig, full_spec: DecoderSpec, max_len: int) -> None:
        """The weights, the KV cache, the sampler and the decode graphs of this rank."""
        spec, world = self.spec, config.tensor_parallel_size
        # The native CPU ops are built and used only when the device is the CPU.
        native_ops = self.device.type == "cpu"
        self.model = load_decoder(
            config.model,
            full_spec,
            self.device,
            self.dtype,
            native_ops,
            tp=self.tp,
            quantization=config.quantization,
            kv_cache_dtype=config.cache.kv_cache_dtype,
        )
        use_kernels(self.model, self.device)
        use_moe_kernels(self.model, self.device)
        self.model.pack_weights()
        if self.device.type == "cpu":
            started = time.perf_counter()
            if moved := weights_onto_huge_pages(self.model):
                logger.info(
                    "weights on huge pages: %d MiB in %.1f s",
                    moved >> 20,
                    time.perf_counter() - started,
                )
        self.lora = None  # LoRA adapters' device slots
        if config.lora.enabled:
            shard = self.tp.shard if self.tp else None
            self.lora = LoRASlotWeights(self.model, spec, full_spec, config.lora, shard)
        self.block_size = config.cache.block_size
        self.sampler = Sampler(config.seed)
        self.pooler = Pooler()  # embedding requests' rows
        self.draft_probs: Callable[[str], torch.Tensor | None] | None = None
        if self.device.type == "cuda":
            self.sampler.warm_up(spec.vocab_size, self.device)
        # The device's time on steps (forward and sampling): its idle share, for benchmarks.
        self.device_clock = DeviceClock(self.device)
        # The last step's sampled tokens on the device: a continuation's inputs (by request).
        self._last_sampled: tuple[list[str], torch.Tensor] = ([], torch.empty(0))
        # Kernels checked (engine/runner/gpu_self_check.py) before the KV budget profiles a
        # step with them and graphs capture them; what they keep on the device is counted.
        check = config.gpu_self_check
        self.self_check: list[PartCheck] = self.check_kernels() if check else []
        dm = self.device_model()  # with the backend the check left
        graph_rows = graph_query_rows(dm, config)
        self._num_blocks = num_cache_blocks(dm, config.cache, config.scheduler, max_len, graph_rows)
        if self.tp is not None:  # every rank holds each block's share of the heads
            self._num_blocks = self.tp.min(self._num_blocks)
        warn_if_short(self._num_blocks * self.block_size, max_len)
        # The scratch block, one past those the KV manager hands out: graph padding writes it.
        self.scratch_block = self._num_blocks
        shape = (self._num_blocks + 1, self.block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = device_caches(shape, self.kv_dtype, self.device, spec.num_layers)
        # A sequence's KV holds every head: this rank's share starts here.
        self._first_kv_head = self.tp.shard.rank * spec.num_kv_heads if self.tp else 0
        self._num_host_blocks = 0
        self.host_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        if config.scheduler.preemption_mode == "swap":
            self._num_host_blocks = config.cache.num_host_blocks or (
                config.cache.swap_space_bytes // world // self.bytes_per_block()
            )
            if self.tp is not None:
                self._num_host_blocks = self.tp.min(self._num_host_blocks)
            host_shape = (self._num_host_blocks, *shape[1:])
            pin = self.device.type == "cuda"
            self.host_caches = host_caches(host_shape, self.kv_dtype, spec.num_layers, pin)
        self.graphs: DecodeGraphs | None = None
        self.spec_graphs: DecodeGraphs | None = None  # rows of a last token and its drafts
        if graph_rows:
            caches, scratch = self.kv_caches, self.scratch_block
            max_seqs = config.scheduler.max_num_seqs
            self.graphs = DecodeGraphs(dm, caches, scratch, max_seqs, max_len)
            self.self_check += self.check_graphs() if check else []
            if len(graph_rows) > 1:
                q = graph_rows[1]
                self.spec_graphs = DecodeGraphs(dm, caches, scratch, max_seqs, max_len, q)
        if config.cache.calculate_kv_scales:  # from the first real step, not dummy ones
            measure_missing_kv_scales(self.model)

    # ------------------------------------------------------------------ ModelRunner API
    def num_kv_blocks(self) -> int:
        return self._num_blocks

    def max_model_len(self) -> int:
        return self._max_model_len

    def num_host_blocks(self) -> int:
        return self._num_host_blocks

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(scheduler_output).result()

    def launch(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """Queue the step on the device (ModelRunner.execute's work); its result waits."""
        if self.workers is None:
            return self._launch(scheduler_output)
        # The other ranks run the same step (KV imports' bytes from the host: their GPUs are
        # not rank 0's).
        for_ranks = scheduler_output
        if imports := scheduler_output.kv_imports:
            on_hosts = [(on_host(kv), block_ids) for kv, block_ids in imports]
            for_ranks = dataclasses.replace(scheduler_output, kv_imports=on_hosts)
        self.workers.send(for_ranks)
        # A failure in a collective, at launch or when collected, names the rank it lost.
        step = RankedStep(self.workers, lambda: self._launch(scheduler_output))
        return ReadyStep(step.result()) if step.ready else step

    def follow(self, step: SchedulerOutput | GatherKV) -> None:
        """Ranks 1..N-1: this rank's share of rank 0's step (its sampling is rank 0's), or of
        its gather of a sequence's KV."""
        if isinstance(step, GatherKV):
            self._gathered_kv(step.block_ids, [], step.swapped)
        else:
            self._launch(step, sample=False).result()

    def use_draft_probs(self, draft_probs: Callable[[str], torch.Tensor | None]) -> None:
        """Rejection sampling: the draft distributions of rows whose drafts were sampled."""
        self.draft_probs = draft_probs

    def use_grammars(self, grammars: GrammarBank) -> None:
        self.sampler.grammars = grammars  # structured outputs: the sampler masks their rows

    def export_kv(
        self, block_ids: list[int], token_ids: list[int], swapped: bool = False
    ) -> SequenceKV | None:
        """The KV of a sequence's first tokens, in `block_ids` (of the host pool where
        `swapped`), every head of it (with tensor parallelism, gathered from the ranks'
        shares): any replica of the model takes it, whatever its ranks. None where it cannot
        leave (FP8 over ranks, each with its own scales; a rank lost)."""
        if self.workers is None:
            caches = self.host_caches if swapped else self.kv_caches
            return read_kv(caches, block_ids, token_ids, self.block_size, self.model)
        if self.kv_dtype == FP8_KV or self.workers.problem() is not None:
            return None
        try:
            self.workers.send(GatherKV(block_ids, swapped))
            return self._gathered_kv(block_ids, token_ids, swapped)
        except RuntimeError as exc:
            logger.warning("a sequence's KV could not be gathered from the ranks: %s", exc)
            return None

    def _gathered_kv(self, block_ids: list[int], token_ids: list[int], swapped: bool) -> SequenceKV:
        assert self.tp is not None
        caches = self.host_caches if swapped else self.kv_caches
        kv = read_kv(caches, block_ids, token_ids, self.block_size, self.model)
        if swapped:  # the group gathers on the ranks' device
            kv = dataclasses.replace(kv, data=kv.data.to(self.device))
        # [layers, 2, blocks, block_size, heads, head_bytes]: the ranks' heads in order.
        return dataclasses.replace(kv, data=self.tp.all_gather(kv.data, dim=4))

    def kv_refusal(self, kv: SequenceKV) -> str | None:
        """Why this cache cannot take `kv` (then the sequence computes it again), or None."""
        world = self.tp.shard.world_size if self.tp is not None else 1
        return refusal(kv, self.kv_caches, self.block_size, world)

    def health_problem(self) -> str | None:
        """Why this runner cannot step (a tensor-parallel rank's process ended), or None."""
        return None if self.workers is None else self.workers.problem()

    def close(self, kill: bool = False) -> None:
        """Stop the other tensor-parallel ranks (they also end when this process ends)."""
        if self.workers is not None:
            self.workers.close(kill)
            self.workers = None

    @torch.inference_mode()
    def _launch(self, scheduler_output: SchedulerOutput, sample: bool = True) -> PendingStep:
        self.sampler.forget(scheduler_output.finished_request_ids)
        self.pooler.forget(scheduler_output.finished_request_ids)
        if scheduler_output.has_swaps:
            swap = scheduler_output.blocks_to_swap_out, scheduler_output.blocks_to_swap_in
            swap_blocks(self.kv_caches, self.host_caches, *swap)
        for kv, block_ids in scheduler_output.kv_imports:
            write_kv(self.kv_caches, kv, block_ids, self.model, self._first_kv_head)
        if scheduler_output.is_empty:
            return ReadyStep(ModelRunnerOutput({}))
        # Decodes first: the attention backend batches them as one call; then by LoRA slot, so
        # that each adapter's tokens are one run of the batch.
        order = sorted(scheduler_output.scheduled, key=lambda r: (r.num_tokens != 1, r.lora_slot))
        started = self.device_clock.start()
        known = step_known_inputs(order, self._last_sampled, self.tp, self.device)
        if self.lora is not None:  # decode graphs run no adapters (yet)
            self.lora.begin_step(scheduler_output.lora_loads, order)
        graphs = (self.graphs or self.spec_graphs) and not (self.lora and self.lora.active)
        # Embedding rows need hidden states, which graphs do not keep.
        logits = self._replay(order, known) if graphs and not has_pooling(order) else None
        pooled = {}
        if logits is None:
            input_ids, positions, layout, logits_indices = self.prepare_inputs(order)
            if known is not None:
                input_ids[known[0]] = known[1]
            metadata = self.backend.prepare(layout)
            inputs = (input_ids, positions, self.kv_caches, self.backend, metadata)
            offsets = layout.query_start_loc
            logits, pooled = self.pooler.forward(self.model, inputs, logits_indices, order, offsets)
        if not sample:
            return ReadyStep(ModelRunnerOutput({}))
        # A row with drafts samples each of its positions (engine/sampling/verification.py).
        sampled = [v for r in order if r.sample for v in verification_rows(r)]
        prompt_logprobs = None
        if len(logits) > len(sampled):  # rows for prompt logprobs follow the sampled rows
            prompt_logprobs = PromptLogprobs(logits[len(sampled) :], order)
            logits = logits[: len(sampled)]
        previous = previous_tokens(order, sampled, known)
        decided = None  # rows whose drafts were sampled: verified by rejection sampling
        if self.draft_probs is not None:
            decided = rejection_verified(self.sampler, logits, sampled, order, self.draft_probs)
        tokens, logprobs = self.sampler.draw(logits, sampled, previous)
        ids = [r.request_id for r in sampled]
        self._last_sampled = (ids, tokens)
        grammars = self.sampler.grammars
        if grammars is not None and not grammars.holds(sampled):
            grammars = None
        clock = self.device_clock
        drafts = {r.request_id: r.token_ids[-r.num_drafts :] for r in order if r.num_drafts}
        step = (ids, tokens, clock, started, grammars, logprobs, prompt_logprobs, drafts)
        return LaunchedStep(*step, decided, pooled)

    def _replay(
        self, order: list[ScheduledRequest], known: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor | None:
        """Logits of the sampled rows of a decode-only step by graph replay, else None: the
        decode graphs', or where rows carry drafts the speculative graphs' (every position of
        a drafted row)."""
        if any(r.num_tokens != 1 + r.num_drafts or r.prompt_targets for r in order):
            return None
        spec = self.spec_graphs
        if any(r.num_drafts for r in order):
            q = spec.tokens_per_row if spec is not None else 0
            if known is not None or any(r.num_tokens > q for r in order):
                return None
            rows = [i * q + j for i, r in enumerate(order) if r.sample for j in range(r.num_tokens)]
            return spec.run(order, None, rows)
        if self.graphs is None:
            return None
        logits = self.graphs.run(order, known)
        if logits is None or all(r.sample for r in order):
            return logits
        # One-token prefill chunks that end before the prompt does sample nothing.
        return logits[[i for i, r in enumerate(order) if r.sample]]

    # ------------------------------------------------------------------- its parts
    def device_model(self) -> DeviceModel:
        """This rank's model and what a step of it takes, for the decode graphs, the KV
        budget and the self-check."""
        world = self.tp.shard.world_size if self.tp is not None else 1
        return DeviceModel(
            self.model, self.spec, self.device, self.dtype, self.kv_dtype, self.block_size,
            self.backend, self.sampler, self.lora, world,
        )  # fmt: skip

    def check_kernels(self) -> list[PartCheck]:
        """The GPU self-check of the kernels (engine/runner/gpu_self_check.py); an attention
        backend that failed is replaced by the reference here."""
        checks = check_kernels(self.device_model())
        if fell_back(checks, "attention"):
            self.backend = TorchAttentionBackend()
            self.backend_reason = "the GPU self-check ruled out the chosen backend"
        return checks

    def check_graphs(self) -> list[PartCheck]:
        """The GPU self-check of the decode graphs: where a replay disagrees with the eager
        step, every step runs eagerly from now on."""
        if self.graphs is None:
            return []
        checks = check_graphs(self.graphs, self.device_model())
        if fell_back(checks, "decode_graph"):
            self.graphs = None
        return checks

    def weight_bytes(self) -> int:
        """Bytes of this rank's weights as its device holds them (the CPU's packed layouts
        too)."""
        return weight_bytes(self.model)

    def bytes_per_block(self) -> int:
        return self.device_model().bytes_per_block()

    def prepare_inputs(
        self, order: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, BatchLayout, torch.Tensor]:
        return packed_inputs(order, self.block_size, self.spec.sliding_window, self.device)
