"""A quantized checkpoint that is broken or that we do not serve fails at start, naming the
tensor or field, and leaves nothing of a half-done load in memory."""

from __future__ import annotations

import gc
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.core.errors import InvalidParam
from engine.model.loader import read_spec
from engine.model.weight_loader import load_decoder
from engine.quant.linear import QuantizedLinear
from tests.conftest import build_engine
from tests.engine.test_quantized_checkpoints import quant_model
from tests.engine.test_tensor_parallel import _Sharded

CPU = torch.device("cpu")


def _broken_copy(fmt: str, tmp_path: Path, edit_tensors=None, edit_config=None) -> str:
    src = Path(quant_model(fmt)[0])
    out = tmp_path / fmt
    shutil.copytree(src, out)
    if edit_tensors is not None:
        tensors = load_file(out / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, out / "model.safetensors")
    if edit_config is not None:
        config = json.loads((out / "config.json").read_text())
        edit_config(config)
        (out / "config.json").write_text(json.dumps(config))
    return str(out)


def _live_quantized_layers() -> int:
    gc.collect()
    return sum(isinstance(o, QuantizedLinear) for o in gc.get_objects())


@pytest.mark.parametrize(
    ("fmt", "tensor"),
    [
        ("ct-fp8-channel", "model.layers.1.mlp.down_proj.weight_scale"),
        ("fp8-block", "model.layers.0.self_attn.v_proj.weight_scale_inv"),
        ("awq", "model.layers.1.self_attn.o_proj.scales"),
        ("gptq", "model.layers.1.mlp.up_proj.qzeros"),
        ("gptq-asym-actorder", "model.layers.0.self_attn.q_proj.g_idx"),
    ],
)
def test_missing_scales_fail_at_start_naming_the_tensor(fmt, tensor, tmp_path):
    model = _broken_copy(fmt, tmp_path, edit_tensors=lambda t: t.pop(tensor))
    before = _live_quantized_layers()
    with pytest.raises(ValueError, match=f"checkpoint has no weight '{tensor}'") as error:
        build_engine(model)
    # Nothing half loaded stays, even while the error (and its traceback) is kept.
    assert error.value.__traceback__ is not None
    assert _live_quantized_layers() <= before


@pytest.mark.parametrize(
    ("fmt", "tensor", "shape"),
    [
        ("awq", "model.layers.0.mlp.gate_proj.qweight", (256, 32)),
        ("gptq", "model.layers.1.self_attn.k_proj.qweight", (16, 256)),
        ("fp8-block", "model.layers.1.mlp.down_proj.weight_scale_inv", (2, 2)),
    ],
)
def test_a_wrong_packed_shape_fails_naming_the_tensor(fmt, tensor, shape, tmp_path):
    def edit(tensors: dict) -> None:
        t = tensors[tensor]
        tensors[tensor] = torch.zeros(shape, dtype=t.dtype)

    model = _broken_copy(fmt, tmp_path, edit_tensors=edit)
    with pytest.raises(ValueError, match=re.escape(f"weight {tensor} has shape {shape}")):
        load_decoder(model, read_spec(model), CPU, torch.float32)


def test_a_wrong_dtype_fails_naming_the_tensor(tmp_path):
    name = "model.layers.0.self_attn.o_proj.weight"

    def edit(tensors: dict) -> None:
        tensors[name] = tensors[name].float()  # FP8 expected

    model = _broken_copy("ct-fp8-channel", tmp_path, edit_tensors=edit)
    with pytest.raises(ValueError, match=f"weight {name} has dtype torch.float32"):
        load_decoder(model, read_spec(model), CPU, torch.float32)


@pytest.mark.parametrize(
    ("edit", "field", "words"),
    [
        (lambda c: c.update(quant_method="bitsandbytes"), "quant_method", "'bitsandbytes'"),
        (lambda c: c.update(bits=8), "bits", "must be 4"),
        (lambda c: c.update(version="gemv"), "version", "must be gemm"),
    ],
)
def test_a_format_we_do_not_serve_names_the_field_and_what_we_serve(edit, field, words, tmp_path):
    model = _broken_copy("awq", tmp_path, edit_config=lambda c: edit(c["quantization_config"]))
    with pytest.raises(InvalidParam, match=words) as error:
        build_engine(model)
    assert error.value.param == f"quantization_config.{field}"
    for served in ("compressed-tensors", "fp8", "awq", "gptq"):
        assert served in str(error.value)


def test_a_split_that_cuts_a_group_names_tensor_parallel_size():
    """o_proj's 256 input columns over 4 ranks are 64 a rank: half a group of 128."""
    model = quant_model("gptq")[0]
    with pytest.raises(InvalidParam, match="tensor_parallel_size 4") as error:
        load_decoder(model, read_spec(model), CPU, torch.float32, tp=_Sharded(0, 4))
    assert error.value.param == "tensor_parallel_size"
    assert "o_proj" in str(error.value)


def test_online_fp8_of_a_quantized_checkpoint_names_quantization():
    with pytest.raises(InvalidParam, match="already quantized") as error:
        build_engine(quant_model("awq")[0], quantization="fp8")
    assert error.value.param == "quantization"
