"""A speculative row's result applied to its request (pure Python)."""

from __future__ import annotations

from engine.core.outputs import EngineCoreOutput
from engine.core.request import Request
from engine.core.sched.state import SchedulerState


def take_verified(
    s: SchedulerState, request: Request, num_drafts: int, tokens: list[int], now: float
) -> EngineCoreOutput:
    """`tokens`: the row's accepted drafts, then the target's next token. The blocks of
    rejected drafts go back; the request ends where a token ends it."""
    request.num_drafts_in_flight = 0
    s.speculator.verified(request.request_id, num_drafts, len(tokens) - 1)
    request.num_computed_tokens += len(tokens)  # the row's last token + accepted drafts
    if request.first_token_time is None:  # drafts after the prompt's last token
        request.first_token_time = now
    tokens, status = request.append_outputs(tokens, s.config.max_model_len)
    if status is not None:
        s.end(request, status)
    else:
        s.kv_cache.trim(request)
        if s.kv_cache.enable_prefix_caching:
            s.kv_cache.cache_full_blocks(request)
    return EngineCoreOutput(request.request_id, tokens, status and status.finish_reason)
