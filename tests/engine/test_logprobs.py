"""Log-probabilities of sampled tokens against the oracle: transformers' log_softmax of the
same model over the same prefix (raw logits: temperature and penalties do not change them)."""

from __future__ import annotations

import random

import torch

from engine.core.sampling_params import SamplingParams
from tests.conftest import build_engine
from tests.engine.oracle import HFOracle
from tests.engine.test_oracle import random_prompts


def _run(engine, prompts, params) -> dict[str, tuple[list[int], list]]:
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    got: dict[str, tuple[list[int], list]] = {f"r{i}": ([], []) for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(out.logprobs or [])
    return got


def test_logprobs_match_transformers_log_softmax(tiny_model):
    engine = build_engine(tiny_model, 4, 200, max_num_seqs=4, max_num_batched_tokens=16)
    oracle = HFOracle(tiny_model)
    prompts = random_prompts(3, 4, max_len=30)
    params = [
        SamplingParams(temperature=0.0, max_tokens=5, logprobs=5, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=4, max_tokens=5, logprobs=0, ignore_eos=True),
        SamplingParams(
            temperature=0.7, top_k=20, presence_penalty=1.0, seed=5, max_tokens=5, logprobs=3
        ),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),  # asks for none
    ]
    got = _run(engine, prompts, params)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        tokens, logprobs = got[f"r{i}"]
        if p.logprobs is None:
            assert logprobs == []
            continue
        assert len(logprobs) == len(tokens) == 5
        for j, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            with torch.no_grad():
                logits = oracle.model(torch.tensor([prompt + tokens[:j]])).logits[0, -1]
            want = logits.float().log_softmax(-1)
            assert abs(lp.logprob - float(want[token])) < 1e-4
            assert len(lp.top) == p.logprobs
            top = torch.topk(want, p.logprobs)
            assert [t for t, _ in lp.top] == top.indices.tolist()
            torch.testing.assert_close(
                torch.tensor([v for _, v in lp.top]), top.values, atol=1e-4, rtol=1e-4
            )
            if p.greedy:
                assert lp.top[0][0] == token


def test_prompt_logprobs_match_the_oracle_across_chunks_and_cached_prefixes(tiny_model):
    # 16-token chunks: a 40-token prompt computes in three steps. The prompt runs twice; the
    # second time its blocks are in the prefix cache, and it must still compute them all.
    engine = build_engine(tiny_model, 4, 200, max_num_seqs=4, max_num_batched_tokens=16)
    oracle = HFOracle(tiny_model)
    prompt = [random.Random(1).randrange(4096) for _ in range(40)]
    with torch.no_grad():
        want = oracle.model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    for run in range(2):
        engine.add_request(f"p{run}", prompt, SamplingParams(max_tokens=3, prompt_logprobs=2))
        firsts = []
        while engine.has_unfinished_requests():
            firsts += [o for o in engine.step() if o.prompt_logprobs is not None]
        assert len(firsts) == 1 and firsts[0].num_output_tokens == 1  # on the first delta only
        entries = firsts[0].prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        for pos in range(1, len(prompt)):
            row = want[pos - 1]
            assert abs(entries[pos].logprob - float(row[prompt[pos]])) < 1e-4
            assert [t for t, _ in entries[pos].top] == torch.topk(row, 2).indices.tolist()
