"""Drafts from a smaller checkpoint in the same replica (speculative `method: draft_model`).

The draft model has a runner of its own (its weights, its paged KV cache, the same kernels)
and a block table per request in a KV manager of its own. Each engine step, every request
that wants drafts is caught up first (the draft computes the request's tokens it has not
seen, at least its last, and draws its first draft), then k - 1 single-token steps draw the
rest; each of those is one batched forward over all such requests. Drafts are greedy, so the
proposer is deterministic and the output with speculation is the output without it; with
`rejection_sampling`, sampled requests' drafts are drawn from the draft's distribution q at
their own temperature and filters instead, and q is kept for the target's verification.

After verification the draft's own tokens past the request's last sync are compared with
what the target accepted; its KV is kept up to where they agree and recomputed from there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.core.config import CacheConfig, EngineConfig, SpeculativeConfig
from engine.core.errors import InvalidParam
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import ScheduledRequest, SchedulerOutput
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.speculator import Speculator
from engine.model.loader import read_spec
from engine.model.model_source import local_checkpoint
from engine.sampling.sampler import Sampler
from engine.sampling.token_draw import inverse_cdf

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
# Sampled drafts draw from a stream of the request's seed apart from the target's draws (the
# residual draw must not depend on the draft's).
DRAFT_SALT = 0x2545F491


class _RecordingSampler(Sampler):
    """The draft runner's sampler under rejection sampling: random rows draw from their
    filtered distribution q, kept by request id, one row per draft, until `recorded` is
    cleared."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.recorded: dict[str, list[torch.Tensor]] = {}

    def draw(self, logits, requests, previous=None):
        tokens, _ = super().draw(logits, requests, previous)
        rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if rows:
            at = torch.tensor(rows, device=logits.device)
            sub = [requests[i] for i in rows]
            q = self.probabilities(logits[at], sub)
            drawn = inverse_cdf(q, self.row_uniforms(sub, logits.device))
            tokens = tokens.index_copy(0, at, drawn.to(tokens.dtype))
            for row, r in zip(q, sub, strict=True):
                self.recorded.setdefault(r.request_id, []).append(row)
        return tokens, None


@dataclass
class _Mirror:
    """The draft's copy of one request: its tokens (the target's, then its own drafts past
    `synced`) and how many of them its KV cache holds."""

    request: Request
    synced: int  # the target's token count when the draft last proposed


class DraftModelProposer:
    dry_means_none_soon = False  # no draft: its copy of a prompt is still being prefilled

    def __init__(self, config: EngineConfig, runner, tokenizer) -> None:
        """`runner`: the target's (its vocabulary, block count and context length)."""
        from engine.runner.torch_runner import TorchModelRunner

        path = local_checkpoint(
            config.speculative.model, "speculative.model",
            endpoint_url=config.object_store_endpoint_url,
        )  # fmt: skip
        try:
            spec = read_spec(path)
        except ValueError as exc:
            raise InvalidParam("speculative.model", f"speculative.model: {exc}") from exc
        _check_same_tokens(path, spec.vocab_size, runner.spec.vocab_size, tokenizer)
        if spec.max_position_embeddings < runner.max_model_len():
            raise InvalidParam(
                "speculative.model",
                f"speculative.model: the draft covers {spec.max_position_embeddings} positions, "
                f"fewer than max_model_len ({runner.max_model_len()})",
            )
        cache = CacheConfig(
            block_size=config.cache.block_size,
            num_blocks=runner.num_kv_blocks(),
            enable_prefix_caching=False,
        )
        draft = replace(
            config,
            model=path,
            cache=cache,
            scheduler=replace(config.scheduler, max_model_len=runner.max_model_len()),
            speculative=SpeculativeConfig(),
            quantization=None,
            tensor_parallel_size=1,
            gpu_self_check=False,
        )
        self.runner = TorchModelRunner(draft)
        self.kv = KVCacheManager(self.runner.num_kv_blocks(), cache.block_size, False)
        self.catch_up_budget = config.scheduler.max_num_batched_tokens
        self._mirrors: dict[str, _Mirror] = {}
        self._sampler: _RecordingSampler | None = None
        if config.speculative.rejection_sampling:
            self._sampler = self.runner.sampler = _RecordingSampler(config.seed)
        self._params: dict[str, tuple[SamplingParams, int]] = {}  # this call's, by request

    def propose(self, wanted: list[tuple[Request, int]]) -> list[list[int]]:
        drafts: dict[str, list[int]] = {}
        if self._sampler is not None:
            self._sampler.recorded.clear()
        self._params = {r.request_id: self._draft_params(r) for r, _ in wanted}
        rows, budget = [], self.catch_up_budget
        live = {r.request_id for r, _ in wanted}
        for request, k in wanted:
            mirror = self._sync(request)
            computed = mirror.num_computed_tokens
            n = min(mirror.num_tokens - computed, budget)
            if n < 1:
                break
            sample = computed + n == mirror.num_tokens  # caught up: the first draft too
            if not self._allocate(mirror, n + (k - 1 if sample else 0), live):
                continue
            tokens = mirror.all_token_ids[computed : computed + n]
            rows.append(self._row(mirror, tokens, sample))
            budget -= n
        k_of = {r.request_id: k for r, k in wanted}
        while rows:
            out = self.runner.execute(SchedulerOutput(rows, sum(r.num_tokens for r in rows)))
            next_rows = []
            for row in rows:
                mirror = self._mirrors[row.request_id].request
                mirror.num_computed_tokens += row.num_tokens
                if not row.sample:
                    continue
                token = out.sampled_token_ids[row.request_id]
                mirror.all_token_ids.append(token)
                mirror.num_tokens += 1
                got = drafts.setdefault(row.request_id, [])
                got.append(token)
                if len(got) < k_of[row.request_id]:
                    next_rows.append(self._row(mirror, [token], True))
            rows = next_rows
        return [drafts.get(r.request_id, []) for r, _ in wanted]

    def draft_probs(self, request_id: str) -> torch.Tensor | None:
        """The distributions the request's drafts of the last `propose` were drawn from,
        [drafts, vocab], or None where they were greedy."""
        if self._sampler is None or request_id not in self._sampler.recorded:
            return None
        return torch.stack(self._sampler.recorded[request_id])

    def forget(self, request_id: str) -> None:
        self._mirrors.pop(request_id, None)
        self.kv.free(request_id)

    # ------------------------------------------------------------------------ helpers
    def _sync(self, request: Request) -> Request:
        """The draft's copy of `request`, its tokens the target's now and its KV kept where
        its own drafts were accepted."""
        tokens = request.all_token_ids
        state = self._mirrors.get(request.request_id)
        if state is None:
            mirror = Request(request.request_id, tokens, GREEDY)
            self._mirrors[request.request_id] = _Mirror(mirror, len(tokens))
            return mirror
        mirror, start = state.request, state.synced
        own = mirror.all_token_ids
        agree = start
        while agree < min(len(own), len(tokens)) and own[agree] == tokens[agree]:
            agree += 1
        mirror.num_computed_tokens = min(mirror.num_computed_tokens, agree)
        del own[start:]
        own += tokens[start:]
        mirror.num_tokens = len(own)
        state.synced = len(tokens)
        return mirror

    def _allocate(self, mirror: Request, n: int, live: set[str]) -> bool:
        """Slots for `n` more tokens; when the pool is dry, the KV of requests that want no
        drafts this step goes first (it is recomputed when they do)."""
        if self.kv.allocate_slots(mirror, n) is not None:
            return True
        for rid in [rid for rid in self._mirrors if rid not in live]:
            self.forget(rid)
        return self.kv.allocate_slots(mirror, n) is not None

    def _row(self, mirror: Request, tokens: list[int], sample: bool) -> ScheduledRequest:
        """The draft's row computing `tokens`; where it samples, the output index of the
        token it draws is the target's next plus the drafts drawn since."""
        rid = mirror.request_id
        params, first_output = self._params[rid]
        drawn = mirror.num_tokens - self._mirrors[rid].synced
        start = mirror.num_computed_tokens
        block_ids = self.kv.block_ids(rid)
        return ScheduledRequest(rid, tokens, start, block_ids, sample, params, first_output + drawn)

    def _draft_params(self, request: Request) -> tuple[SamplingParams, int]:
        """How the draft draws for `request`, and the output index of its next token."""
        params = request.sampling_params
        if self._sampler is None or params.greedy:
            return GREEDY, request.num_output_tokens
        seed = None if params.seed is None else params.seed ^ DRAFT_SALT
        filters = {f: getattr(params, f) for f in ("temperature", "top_k", "top_p", "min_p")}
        return SamplingParams(max_tokens=1, seed=seed, **filters), request.num_output_tokens


def _check_same_tokens(path: str, draft_vocab: int, target_vocab: int, tokenizer) -> None:
    if draft_vocab != target_vocab:
        raise InvalidParam(
            "speculative.model",
            f"speculative.model: the draft's vocabulary ({draft_vocab}) is not the target's "
            f"({target_vocab})",
        )
    if tokenizer is None:
        return
    from transformers import AutoTokenizer

    if AutoTokenizer.from_pretrained(path).get_vocab() != tokenizer.get_vocab():
        raise InvalidParam(
            "speculative.model", "speculative.model: the draft's tokenizer is not the target's"
        )


def speculator_for(config: EngineConfig, runner, tokenizer) -> Speculator | None:
    """The engine's speculator as its config asks (None: speculation off)."""
    spec = config.speculative
    if not spec.enabled:
        return None
    proposer = None
    if spec.method == "draft_model":
        proposer = DraftModelProposer(config, runner, tokenizer)
        if spec.rejection_sampling:
            runner.use_draft_probs(proposer.draft_probs)
    return Speculator(spec, proposer, token_tile=step_token_tile(runner))


def step_token_tile(runner) -> int:
    """Tokens a step's cost moves by: the native CPU GEMM's panel, where it runs; else 1."""
    ops = getattr(getattr(runner, "model", None), "ops", None)
    return getattr(ops, "token_panel", 1)
