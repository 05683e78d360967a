"""Embedding requests through the engine: the prompt is computed (prefill only, in chunks
like any prompt) and the request ends with its final hidden states pooled (last token or
mean, L2-normalized or not), equal to transformers' hidden states pooled the same way,
whatever the batch, the chunking, prefix cache hits, deferred steps or preemption; they
share steps with generating requests, whose tokens do not change, and leave no block."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from engine.core.sampling_params import SamplingParams
from tests.conftest import build_engine

PROMPTS = [
    [5, 17, 99, 3],
    list(range(10, 47)),
    [7] * 3 + list(range(200, 260)),
    [42],
]


@pytest.fixture(scope="module")
def hf_hidden(tiny_model):
    model = AutoModel.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def hidden(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([prompt])).last_hidden_state[0]

    return hidden


def expected(hidden: torch.Tensor, pooling: str, normalize: bool) -> torch.Tensor:
    vector = hidden[-1] if pooling == "last" else hidden.mean(0)
    return F.normalize(vector, dim=0) if normalize else vector


def embed(engine, prompts, params, generate=(), max_tokens=12) -> tuple[dict, dict]:
    """`generate` prompts decoded greedily (request ids g0, ...) and every prompt embedded
    (e0, e1, ...), added in that order: the vectors and the generated tokens."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.preempted_embeddings = 0
    for i, prompt in enumerate(generate):
        engine.add_request(f"g{i}", prompt, greedy)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"e{i}", prompt, params)
    vectors, tokens = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished and out.request_id.startswith("e"):
                assert out.finish_reason == "stop" and out.new_token_ids == []
                assert out.num_output_tokens == 0
                vectors[out.request_id] = torch.tensor(out.embedding)
                engine.preempted_embeddings += out.num_preemptions
    stats = engine.scheduler.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    return vectors, {k: v for k, v in tokens.items() if k.startswith("g")}


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_embeddings_equal_transformers_hidden_states_pooled(
    tiny_model, hf_hidden, pooling, normalize
):
    params = SamplingParams(max_tokens=1, pooling=pooling, normalize=normalize)
    # A 16-token budget: the long prompts are computed in chunks.
    engine = build_engine(tiny_model, max_num_batched_tokens=16)
    vectors, _ = embed(engine, PROMPTS, params)
    for i, prompt in enumerate(PROMPTS):
        want = expected(hf_hidden(prompt), pooling, normalize)
        assert torch.allclose(vectors[f"e{i}"], want, atol=1e-5, rtol=0), (i, pooling)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_are_batch_independent_and_share_steps_with_generation(tiny_model, pooling):
    params = SamplingParams(max_tokens=1, pooling=pooling)
    alone = {}
    for i, prompt in enumerate(PROMPTS):
        engine = build_engine(tiny_model)
        alone[i] = embed(engine, [prompt], params)[0]["e0"]
    generated_alone = embed(build_engine(tiny_model), [], params, PROMPTS[:2])[1]
    # Together, generating beside them, with deferred steps and the prompts' blocks cached
    # by an earlier round (prefix cache hits for "last"; "mean" computes every position).
    engine = build_engine(tiny_model, deferred_steps=True, max_num_batched_tokens=24)
    for _ in range(2):
        vectors, generated = embed(engine, PROMPTS, params, PROMPTS[:2])
        for i in range(len(PROMPTS)):
            assert torch.allclose(vectors[f"e{i}"], alone[i], atol=1e-5, rtol=0), i
        assert generated == generated_alone


def test_a_mean_pooled_request_preempted_by_recompute_starts_its_sum_again(tiny_model, hf_hidden):
    """A cache too small for everyone: the youngest requests, the embeddings, are preempted
    (recompute) while the generating ones grow, and compute their prompts again."""
    params = SamplingParams(max_tokens=1, pooling="mean")
    engine = build_engine(tiny_model, num_blocks=24, max_num_batched_tokens=8)
    prompts = [list(range(100 + 7 * i, 130 + 7 * i)) for i in range(3)]
    generate = [list(range(30, 50)), list(range(60, 75))]
    vectors, _ = embed(engine, prompts, params, generate, max_tokens=30)
    assert engine.preempted_embeddings > 0
    for i, prompt in enumerate(prompts):
        want = expected(hf_hidden(prompt), "mean", True)
        assert torch.allclose(vectors[f"e{i}"], want, atol=1e-5, rtol=0), i


def test_an_unknown_pooling_is_refused_naming_the_field():
    from engine.core.errors import InvalidParam

    with pytest.raises(InvalidParam) as info:
        SamplingParams(pooling="max")
    assert info.value.param == "pooling"
