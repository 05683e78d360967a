"""The streaming weight loader: weights land in place in the target dtype, host memory while
loading stays near the checkpoint's size, and checkpoints it cannot load are refused with
the reason."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.model.loader import read_spec
from engine.model.random_checkpoint import make_random_checkpoint
from engine.model.weight_loader import load_decoder
from tests.conftest import REPO, tiny_model_dir


def _weights(model_dir: str) -> dict[str, torch.Tensor]:
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def _copy_checkpoint(src: str, dst: Path, config: dict | None = None, weights=None) -> str:
    dst.mkdir()
    for file in Path(src).iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy(file, dst / file.name)
    cfg = json.loads((Path(src) / "config.json").read_text()) | (config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    if weights is None:
        shutil.copy(Path(src) / "model.safetensors", dst / "model.safetensors")
    else:
        save_file(weights, str(dst / "model.safetensors"))
    return str(dst)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_land_in_their_fused_slices_in_the_target_dtype(dtype):
    model_dir = tiny_model_dir("qwen2")  # q/k/v biases, tied embeddings
    spec = read_spec(model_dir)
    decoder = load_decoder(model_dir, spec, torch.device("cpu"), dtype)
    hf = _weights(model_dir)
    attn = decoder.layers[1].self_attn
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    assert attn.qkv_proj.weight.dtype == dtype
    layer = "model.layers.1.self_attn."
    assert torch.equal(attn.qkv_proj.weight[q : q + kv], hf[layer + "k_proj.weight"].to(dtype))
    assert torch.equal(attn.qkv_proj.bias[q + kv :], hf[layer + "v_proj.bias"].to(dtype))
    up = decoder.layers[1].mlp.gate_up_proj.weight[spec.intermediate_size :]
    assert torch.equal(up, hf["model.layers.1.mlp.up_proj.weight"].to(dtype))
    assert decoder.lm_head.weight is decoder.embed_tokens.weight
    assert not any(p.is_meta for p in decoder.parameters())
    assert not any(b.is_meta for b in decoder.buffers())


def test_a_missing_or_misshaped_weight_is_named(tmp_path):
    src = tiny_model_dir()
    weights = _weights(src)
    del weights["model.layers.2.mlp.down_proj.weight"]
    missing = _copy_checkpoint(src, tmp_path / "missing", weights=weights)
    with pytest.raises(ValueError, match="model.layers.2.mlp.down_proj.weight"):
        load_decoder(missing, read_spec(missing), torch.device("cpu"), torch.float32)
    weights = _weights(src)
    weights["model.norm.weight"] = weights["model.norm.weight"][:-1].clone()
    misshaped = _copy_checkpoint(src, tmp_path / "misshaped", weights=weights)
    with pytest.raises(ValueError, match="model.norm.weight has shape"):
        load_decoder(misshaped, read_spec(misshaped), torch.device("cpu"), torch.float32)


_MEASURE = """
import json, os, sys, torch
from engine.model.loader import read_spec
from engine.model.weight_loader import load_decoder

def status(field):  # kB figures of this process's own memory (not inherited across exec)
    line = next(l for l in open("/proc/self/status") if l.startswith(field + ":"))
    return int(line.split()[1]) * 1024

# Warm-up on the tiny model: torch pages in its code on first use (about 150 MB, the same
# whatever the model's size); what is measured is what loading the big one adds.
load_decoder(sys.argv[2], read_spec(sys.argv[2]), torch.device("cpu"), torch.bfloat16)
spec = read_spec(sys.argv[1])
before = status("VmRSS")
quantization = None if sys.argv[3] == "none" else sys.argv[3]
decoder = load_decoder(
    sys.argv[1], spec, torch.device("cpu"), torch.bfloat16, quantization=quantization
)
# VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss over from the forking parent.
print(json.dumps({"before": before, "peak": status("VmHWM")}))
"""


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory) -> tuple[Path, int]:
    model_dir = make_random_checkpoint(
        tmp_path_factory.mktemp("big") / "500m", "500m", shard_bytes=600 << 20
    )
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    assert len(list(model_dir.glob("*.safetensors"))) == 2
    assert 0.9e9 < size < 1.1e9
    return model_dir, size


def _grown(model_dir: Path, quantization: str) -> int:
    run = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(model_dir), tiny_model_dir(), quantization],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        check=True,
    )
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    return figures["peak"] - figures["before"]


def test_peak_host_memory_while_loading_is_near_the_checkpoint_size(big_checkpoint):
    """A ~500M-parameter bfloat16 checkpoint loads with at most 1.3x its bytes of new
    resident memory (a float32 build cast afterwards, or a state dict beside the model,
    would need 2-4x)."""
    model_dir, size = big_checkpoint
    grown = _grown(model_dir, "none")
    assert grown <= 1.3 * size, f"loading took {grown / size:.2f}x the checkpoint's bytes"
    assert grown >= 0.9 * size  # the weights themselves are resident: the measure is real


def test_online_fp8_peaks_below_the_unquantized_load(big_checkpoint):
    """Quantized one weight at a time: the linear weights' bytes halve (embeddings stay
    bfloat16), and nothing of the whole float model is held: the peak stays below 0.85x, where
    the unquantized load needs at least 0.9x."""
    model_dir, size = big_checkpoint
    grown = _grown(model_dir, "fp8")
    assert grown <= 0.85 * size, f"online fp8 took {grown / size:.2f}x the checkpoint's bytes"


def test_a_sharded_random_checkpoint_is_one_transformers_loads(big_checkpoint):
    """Its shards come with the index that names each weight's file, as a published
    checkpoint's do, so reference tools (transformers) read it too."""
    from transformers import AutoModelForCausalLM

    model_dir, _ = big_checkpoint
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    name = "model.layers.15.mlp.down_proj.weight"
    with safe_open(str(model_dir / index["weight_map"][name]), framework="pt") as f:
        assert torch.equal(model.state_dict()[name], f.get_tensor(name))
