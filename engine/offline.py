"""Offline generation: prompts run to completion on an LLMEngine, no server."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.errors import InvalidParam
from engine.core.outputs import GenerationResult
from engine.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


def run_to_completion(
    engine: LLMEngine,
    prompts: list[str] | list[list[int]],
    params: SamplingParams | list[SamplingParams] | None = None,
    loras: list[str | None] | None = None,
) -> list[GenerationResult]:
    """Every prompt's result, in prompt order (one SamplingParams for all, or one each)."""
    if params is None or isinstance(params, SamplingParams):
        params = [params or SamplingParams()] * len(prompts)
    if len(params) != len(prompts):
        raise InvalidParam("params", "params: need one SamplingParams per prompt")
    loras = loras or [None] * len(prompts)
    if len(loras) != len(prompts):
        raise InvalidParam("loras", "loras: need one adapter name (or None) per prompt")
    engine.num_generate_calls += 1
    ids = [f"generate-{engine.num_generate_calls}-{i}" for i in range(len(prompts))]
    results: dict[str, GenerationResult] = {}
    for rid, prompt, p, lora in zip(ids, prompts, params, loras, strict=True):
        req = engine.make_request(rid, prompt, p, lora=lora)
        engine.add_prepared(req)
        results[rid] = GenerationResult(rid, req.prompt_token_ids, [], "", None)
    while engine.has_unfinished_requests():
        for out in engine.step():
            res = results.get(out.request_id)
            if res is None:
                continue
            res.token_ids.extend(out.new_token_ids)
            res.text += out.new_text
            if out.finished:
                res.finish_reason = out.finish_reason
    return [results[rid] for rid in ids]
