"""`kv_cache_dtype: fp8_e4m3`: the same bytes hold twice the blocks of a 16-bit cache,
attention reads the cache as it holds it (torch and triton alike) within a stated tolerance of
a float cache, outputs do not depend on batching, chunking, preemption or tensor parallelism,
and every block comes back after abort, failure and preemption."""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

# NOTE: read when the triton kernels are defined, so before they are imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.attention.base import FP8_KV, quantize_kv  # noqa: E402
from engine.attention.registry import AttentionShape, get_attention_backend  # noqa: E402
from engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine.core.config import CacheConfig, EngineConfig  # noqa: E402
from engine.core.errors import InvalidParam  # noqa: E402
from engine.core.sampling_params import SamplingParams  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from tests.conftest import build_engine, tiny_model_dir  # noqa: E402
from tests.engine.test_attention_backend import dense_reference, make_case  # noqa: E402
from tests.engine.test_oracle import random_prompts, run_mix, scenario_engine  # noqa: E402

# The stated tolerance: attention over an FP8 cache (e4m3, per-tensor scale) stays within
# this RMS error, relative to the outputs' RMS, of attention over the float cache.
FP8_ATTENTION_RMS_TOLERANCE = 0.05

SHAPES = [(0, 1), (5, 1), (37, 1), (0, 9), (11, 6), (32, 20), (3, 70)]


def _fp8_case(seed: int, scale: float):
    layout, q, k, v, k_cache, v_cache, contexts = make_case(seed, 8, 2, 64, 16, SHAPES)
    scales = (torch.tensor(scale), torch.tensor(scale))
    caches = quantize_kv(k_cache, scales[0]), quantize_kv(v_cache, scales[1])
    return layout, q, k, v, caches, scales, contexts


def _rounded(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return quantize_kv(x, scale).float() * scale


@pytest.mark.parametrize("backend", [TorchAttentionBackend, TritonAttentionBackend])
@pytest.mark.parametrize("scale", [1.0, 4.5 / 448])
def test_attention_reads_the_fp8_cache_as_it_holds_it(backend, scale):
    """Exact to the dense reference over the cache's own values (fresh tokens included), and
    within the stated tolerance of the float cache's attention."""
    layout, q, k, v, (k_cache, v_cache), scales, contexts = _fp8_case(3, scale)
    out = backend().forward(
        q, k, v, k_cache, v_cache, backend().prepare(layout), 0.125, kv_scales=scales
    )
    written = k_cache.view(torch.uint8).view(-1, 2, 64)[layout.slot_mapping].view(FP8_KV)
    assert torch.equal(written, quantize_kv(k, scales[0]))
    errors, norms = [], []
    for i, (ctx_k, ctx_v) in enumerate(contexts):
        rows = slice(layout.query_start_loc[i], layout.query_start_loc[i + 1])
        held = _rounded(ctx_k, scales[0]), _rounded(ctx_v, scales[1])
        want = dense_reference(q[rows], *held, 0.125, None)
        torch.testing.assert_close(out[rows], want, atol=2e-5, rtol=1e-4)
        exact = dense_reference(q[rows], ctx_k, ctx_v, 0.125, None)
        errors.append((out[rows] - exact).pow(2).sum())
        norms.append(exact.pow(2).sum())
    assert (sum(errors) / sum(norms)).sqrt() < FP8_ATTENTION_RMS_TOLERANCE


def test_the_same_budget_holds_exactly_twice_the_blocks_of_a_16_bit_cache(tiny_model):
    def blocks(dtype: str, kv: str) -> int:
        cache = CacheConfig(block_size=16, kv_cache_bytes=8 << 20, kv_cache_dtype=kv)
        config = EngineConfig(model=tiny_model, dtype=dtype, cache=cache)
        engine = LLMEngine(config)
        assert engine.scheduler.kv_cache.num_blocks == engine.runner.num_kv_blocks()
        return engine.runner.num_kv_blocks()

    assert blocks("bfloat16", "fp8_e4m3") == 2 * blocks("bfloat16", "auto")
    assert blocks("float32", "fp8_e4m3") == 4 * blocks("float32", "auto")


def _mix(model: str, scenario: str, n: int = 10, **engine_args) -> dict[int, list[int]]:
    """The tokens of the first `n` prompts of one mix."""
    engine = scenario_engine(model, scenario, kv_cache_dtype="fp8_e4m3", **engine_args)
    try:
        assert engine.runner.kv_caches[0][0].dtype == FP8_KV
        rng = random.Random(0)
        prompts = random_prompts(0, 10, max_len=40)[:n]
        max_tokens = [rng.randint(1, 16) for _ in prompts]
        return run_mix(engine, prompts, max_tokens, [rng.randint(0, 5) for _ in prompts])
    finally:
        engine.close()


def test_fp8_tokens_do_not_depend_on_batching_chunking_or_preemption(tiny_model):
    """run_mix also checks that every block is free when the requests are done."""
    roomy = _mix(tiny_model, "roomy")
    assert _mix(tiny_model, "chunked+preemption") == roomy
    assert _mix(tiny_model, "preemption", preemption_mode="swap", num_host_blocks=40) == roomy
    interpreted = _mix(tiny_model, "roomy", n=4, attention_backend="triton")  # slow: fewer
    assert interpreted == {i: roomy[i] for i in range(4)}
    assert _mix(tiny_model, "roomy", tensor_parallel_size=2) == roomy


def test_every_fp8_block_comes_back_after_abort_and_failure(tiny_model):
    engine = build_engine(tiny_model, num_blocks=60, kv_cache_dtype="fp8_e4m3")
    kv = engine.scheduler.kv_cache
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", list(range(5 + 7 * i)), greedy)
    engine.step()
    engine.step()
    assert kv.num_free_blocks < kv.num_blocks
    engine.abort("r0")
    engine.step()
    real_launch = engine.runner.launch

    def fault_once(scheduler_output):  # a device error in one step
        engine.runner.launch = real_launch
        raise RuntimeError("injected device fault")

    engine.runner.launch = fault_once
    outs = engine.step()
    assert {o.finish_reason for o in outs} == {"error"}
    engine.scheduler.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks
    assert len(engine.generate([[1, 2, 3]], greedy)[0].token_ids) == 20


def test_scales_come_from_the_checkpoint_or_the_first_step(tmp_path):
    src = tiny_model_dir()
    model = tmp_path / "with-kv-scales"
    shutil.copytree(src, model)
    weights = load_file(model / "model.safetensors")
    weights["model.layers.1.self_attn.k_scale"] = torch.tensor(0.25)
    weights["model.layers.1.self_attn.v_scale"] = torch.tensor([0.5])
    save_file(weights, model / "model.safetensors")
    engine = build_engine(str(model), kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True)
    layers = engine.runner.model.layers
    assert [float(s) for s in layers[1].self_attn.kv_scales] == [0.25, 0.5]
    assert [float(s) for s in layers[0].self_attn.kv_scales] == [1.0, 1.0]
    engine.generate(["a prompt of a few tokens"], SamplingParams(temperature=0.0, max_tokens=2))
    measured = [float(s) for s in layers[0].self_attn.kv_scales]
    assert all(0 < s < 1.0 for s in measured)  # the tiny model's k and v stay far below 448
    assert [float(s) for s in layers[1].self_attn.kv_scales] == [0.25, 0.5]


def test_backends_that_read_only_float_caches_are_ruled_out_naming_kv_cache_dtype():
    shape = AttentionShape("cpu", "float32", 64, 16, "fp8_e4m3")
    backend, reason = get_attention_backend("auto", shape)
    assert backend.name == "torch" and "fp8_e4m3" in reason
    with pytest.raises(InvalidParam) as error:
        get_attention_backend("cpu", shape)
    assert error.value.param == "kv_cache_dtype"
    cuda = AttentionShape("cuda", "bfloat16", 128, 16, "fp8_e4m3")
    with pytest.raises(InvalidParam, match="kv_cache_dtype"):
        get_attention_backend("flashinfer", cuda)


def test_metrics_say_what_the_cache_holds(tiny_model):
    from prometheus_client.parser import text_string_to_metric_families

    from cluster.control import ControlDecision, ReplicaStats
    from serve_app.observability.telemetry import render_engine_metrics

    engine = build_engine(tiny_model, num_blocks=96, kv_cache_dtype="fp8_e4m3")
    stats = ReplicaStats("r1", engine.stats(), 0, 8, cache_dtype="fp8_e4m3", kv_block_size=4)
    text = render_engine_metrics([("tiny", stats, ControlDecision(engine.scheduler.limits))])
    (sample,) = [
        s
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
        if s.name == "dynabatch:cache_config_info"
    ]
    assert sample.labels["num_gpu_blocks"] == "96" and sample.labels["cache_dtype"] == "fp8_e4m3"
