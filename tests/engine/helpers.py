"""Build schedulers from literals and drive them with hand-made runner outputs."""

from __future__ import annotations

from engine.core.config import SchedulerConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.sched.scheduler import Scheduler

EOS = 2


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    batching: str = "continuous",
    enable_prefix_caching: bool = False,
) -> Scheduler:
    """Prefix caching is off by default here: these hand-computed cases count blocks and
    recompute exactly (tests/engine/test_prefix_caching.py covers it on)."""
    config = SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, batching)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching))


def make_request(
    rid: str, prompt_len: int, max_tokens: int = 4, ignore_eos: bool = True, **params
) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos, **params)
    return Request(rid, [10 + (i % 50) for i in range(prompt_len)], sp, eos_token_ids=(EOS,))


def fake_run(out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """A runner that samples `token` for every request that reached its end."""
    return ModelRunnerOutput({s.request_id: token for s in out.scheduled if s.sample})


def step(sched: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    out = sched.schedule()
    results = sched.update_from_output(out, fake_run(out, token))
    sched.check_integrity()
    return out, results


def run_to_end(sched: Scheduler, max_steps: int = 10_000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return tokens
        _, results = step(sched)
        for r in results:
            tokens.setdefault(r.request_id, []).extend(r.new_token_ids)
    raise AssertionError("scheduler did not drain")
