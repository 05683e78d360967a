"""Quantized checkpoints (compressed-tensors FP8, fine-grained FP8 blocks, AWQ, GPTQ, and
online FP8) load as the public implementations read them, and serve token-exact against their
dequantized float model at tensor-parallel sizes 1 and 2, with chunked prefill and
preemption."""

from __future__ import annotations

import random

import pytest
import torch

from engine.model.loader import read_spec
from engine.model.tiny_model import make_model
from engine.model.weight_loader import load_decoder
from engine.quant.checkpoint_writer import FORMATS, write_quantized
from engine.quant.linear import QuantizedLinear
from engine.quant.packing import AWQ_ORDER, unpack_columns, unpack_rows
from tests.conftest import REPO, tiny_model_dir
from tests.engine.oracle import HFOracle
from tests.engine.test_oracle import check_against_oracle, random_prompts, run_mix, scenario_engine
from tests.engine.test_tensor_parallel import _Sharded

CPU = torch.device("cpu")


def quant_model(fmt: str) -> tuple[str, str]:
    """(the checkpoint in `fmt`, its dequantized float32 twin), written once under models/."""
    src = make_model(REPO / "models" / "tiny-quant", size="tiny-quant")
    out, twin = write_quantized(src, REPO / "models" / "quant" / fmt, fmt)
    return str(out), str(twin)


def _load(model: str, **kwargs) -> torch.nn.Module:
    return load_decoder(model, read_spec(model), CPU, torch.float32, **kwargs)


def _layer(decoder: torch.nn.Module, i: int, module: str) -> QuantizedLinear:
    layer = decoder.layers[i].get_submodule(module)
    assert isinstance(layer, QuantizedLinear)
    return layer


# ------------------------------------------------------------------ the formats' own readers
@pytest.mark.parametrize("fmt", ["ct-fp8-tensor", "ct-fp8-channel", "ct-fp8-block", "fp8-block"])
def test_fp8_weights_equal_transformers_and_compressed_tensors_decompression(fmt):
    """transformers' loaders (compressed-tensors' decompressor for compressed-tensors, its
    fine-grained FP8 loader for `fp8`) give each float weight ours computes with. They
    compute in the scale's dtype (bfloat16 channel scales), so that is where they are
    compared."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model, _ = quant_model(fmt)
    kwargs = {"quantization_config": CompressedTensorsConfig(run_compressed=False)}
    hf = AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.float32, **(kwargs if fmt.startswith("ct-") else {})
    )
    ours = _load(model)
    scale_dtype = torch.bfloat16 if fmt == "ct-fp8-channel" else torch.float32
    for i, hf_layer in enumerate(hf.model.layers):
        for module, parts in (
            ("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
            ("self_attn.o_proj", ("o_proj",)),
            ("mlp.gate_up_proj", ("gate_proj", "up_proj")),
            ("mlp.down_proj", ("down_proj",)),
        ):
            parent = module.split(".")[0]
            theirs = [getattr(getattr(hf_layer, parent), p).weight for p in parts]
            mine = _layer(ours, i, module).dequantized(scale_dtype).float()
            assert torch.equal(mine, torch.cat(theirs)), (fmt, i, module)


def test_awq_packing_fixture():
    """AutoAWQ's GEMM packing, by hand: columns 0..7 hold codes 0..7, nibble j holds column
    AWQ_ORDER[j] = (0, 2, 4, 6, 1, 3, 5, 7), so the word reads 0x75316420."""
    word = torch.tensor([[0x75316420]], dtype=torch.int32)
    assert unpack_columns(word, AWQ_ORDER).tolist() == [list(range(8))]
    # The top nibble (column 7, code 15) sets the sign bit of the int32.
    word = torch.tensor([[0xF5316420 - (1 << 32)]], dtype=torch.int32)
    assert unpack_columns(word, AWQ_ORDER).tolist() == [[0, 1, 2, 3, 4, 5, 6, 15]]


def test_gptq_packing_fixture():
    """GPTQ's qweight packs eight input rows per word in order (nibble j = row 8r + j);
    its qzeros pack eight output columns in order, each stored minus one in v1."""
    qweight = torch.tensor([[0x76543210, 0x01234567]], dtype=torch.int32)  # [K/8=1, N=2]
    assert unpack_rows(qweight).t().tolist() == [list(range(8)), list(range(7, -1, -1))]
    qzeros = torch.tensor([[0x777777F7]], dtype=torch.int32)
    stored = unpack_columns(qzeros)
    assert stored.tolist() == [[7, 15, 7, 7, 7, 7, 7, 7]]
    assert ((stored.int() + 1) & 0xF).tolist() == [[8, 0, 8, 8, 8, 8, 8, 8]]


@pytest.mark.parametrize("fmt", ["awq", "gptq", "gptq-asym-actorder", "gptq-v2"])
def test_int4_weights_equal_a_plain_reading_of_the_format(fmt):
    """Every weight of a layer, read from the checkpoint's raw tensors by the formats'
    published arithmetic one element at a time, equals what our layer computes with."""
    from safetensors.torch import load_file

    model, _ = quant_model(fmt)
    raw = load_file(f"{model}/model.safetensors")
    layer = _layer(_load(model), 1, "self_attn.qkv_proj")
    mine = layer.dequantized()
    base = "model.layers.1.self_attn.k_proj."
    qweight, qzeros, scales = (raw[base + t] for t in ("qweight", "qzeros", "scales"))
    g_idx = raw.get(base + "g_idx")
    k_rows = slice(256, 512)  # k_proj's rows in the fused qkv layer
    rng = random.Random(0)
    for _ in range(300):
        n, k = rng.randrange(256), rng.randrange(256)
        g = int(g_idx[k]) if fmt == "gptq-asym-actorder" else k // 128
        if fmt == "awq":
            q = (int(qweight[k, n // 8]) >> (4 * AWQ_ORDER.index(n % 8))) & 0xF
            z = (int(qzeros[g, n // 8]) >> (4 * AWQ_ORDER.index(n % 8))) & 0xF
        else:
            q = (int(qweight[k // 8, n]) >> (4 * (k % 8))) & 0xF
            offset = 0 if fmt == "gptq-v2" else 1  # v1 stores each zero point minus one
            z = ((int(qzeros[g, n // 8]) >> (4 * (n % 8))) + offset) & 0xF
        expected = (q - z) * float(scales[g, n])
        assert float(mine[k_rows][n, k]) == expected, (fmt, n, k)


# ------------------------------------------------------------------------------ the oracle
ORACLE_CASES = [(fmt, 1, "chunked+preemption") for fmt in FORMATS] + [
    ("ct-fp8-channel", 2, "chunked+preemption"),
    ("fp8-block", 2, "preemption"),
    ("awq", 2, "chunked-prefill"),
    ("gptq-asym-actorder", 2, "chunked+preemption"),
    ("online-fp8", 2, "roomy"),
]


@pytest.mark.parametrize(("fmt", "world", "scenario"), ORACLE_CASES)
def test_greedy_tokens_equal_hf_on_the_dequantized_model(fmt, world, scenario):
    model, twin = quant_model(fmt)
    online = {"quantization": "fp8"} if fmt == "online-fp8" else {}
    engine = scenario_engine(model, scenario, tensor_parallel_size=world, **online)
    try:
        assert engine.runner.model.layers[0].self_attn.qkv_proj.__class__ is QuantizedLinear
        rng = random.Random(world)
        prompts = random_prompts(world, 10, max_len=40)
        max_tokens = [rng.randint(1, 16) for _ in prompts]
        tokens = run_mix(engine, prompts, max_tokens, [rng.randint(0, 5) for _ in prompts])
    finally:
        engine.close()
    check_against_oracle(HFOracle(twin), prompts, max_tokens, tokens)


def test_quantized_layers_keep_their_biases_qwen2():
    """Qwen2's q/k/v biases stay float beside the INT4 weights (and its embeddings tied)."""
    src = tiny_model_dir("qwen2")
    model, twin = write_quantized(src, REPO / "models" / "quant" / "awq-qwen2", "awq", 32)
    engine = scenario_engine(str(model), "chunked+preemption")
    try:
        qkv = engine.runner.model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv, QuantizedLinear) and qkv.bias is not None
        rng = random.Random(5)
        prompts = random_prompts(5, 8, max_len=30)
        max_tokens = [rng.randint(1, 12) for _ in prompts]
        tokens = run_mix(engine, prompts, max_tokens, [rng.randint(0, 4) for _ in prompts])
    finally:
        engine.close()
    check_against_oracle(HFOracle(str(twin)), prompts, max_tokens, tokens)


# ------------------------------------------------------------------- tensor parallel loading
@pytest.mark.parametrize("fmt", ["ct-fp8-channel", "fp8-block", "awq", "gptq-asym-actorder"])
def test_each_rank_reads_its_share_and_holds_its_slice(fmt):
    model, _ = quant_model(fmt)
    whole = _load(model, native_ops=False)
    shares = []
    for rank in range(2):
        part = _load(model, native_ops=False, tp=_Sharded(rank, 2))
        shares.append(part.loaded_bytes)
        for i in range(2):
            # Column-parallel: this rank's k_proj rows; row-parallel: its down_proj columns.
            qkv = _layer(part, i, "self_attn.qkv_proj").dequantized()
            full = _layer(whole, i, "self_attn.qkv_proj").dequantized()
            k_rows = slice(256 + rank * 128, 256 + (rank + 1) * 128)
            assert torch.equal(qkv[128:256], full[k_rows])
            down = _layer(part, i, "mlp.down_proj").dequantized()
            full = _layer(whole, i, "mlp.down_proj").dequantized()
            assert torch.equal(down, full[:, rank * 256 : (rank + 1) * 256])
    # Each rank reads about half (norms are read whole, act-order scales by every rank).
    for share in shares:
        assert 0.45 < share / whole.loaded_bytes < 0.6, (fmt, share / whole.loaded_bytes)
