"""Host memory tuning: the KV cache and the weights on transparent huge pages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.core.config import EngineConfig
from engine.cpu.host_memory import huge_pages_on, weights_onto_huge_pages, zeros_on_huge_pages
from engine.cpu.packed_weights import PackedLinear
from engine.llm_engine import LLMEngine
from tests.conftest import tiny_model_dir

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kib() -> int:
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(re.search(r"^AnonHugePages:\s+(\d+) kB", text, re.MULTILINE).group(1))


def test_zeros_on_huge_pages_is_zeroed_and_shaped():
    t = zeros_on_huge_pages((3, 5, 7), torch.float32)
    assert t.shape == (3, 5, 7) and t.dtype == torch.float32
    assert not t.any()
    big = zeros_on_huge_pages((64, 16, 4, 64), torch.float32)  # 1 MiB: below one huge page
    assert not big.any()


def test_kv_sized_tensor_lands_on_huge_pages():
    if not _THP.exists() or "[never]" in _THP.read_text():
        pytest.skip("transparent huge pages are off on this machine")
    before = _anon_huge_kib()
    t = zeros_on_huge_pages((1024, 16, 4, 64), torch.float32)  # 64 MiB
    grown = _anon_huge_kib() - before
    assert not t.any()
    # On a long-running machine memory is fragmented and the kernel backs only part of it
    # with huge pages (7 of 32 measured here), but without the advice none at all.
    assert grown >= 2048, f"none of the 64 MiB tensor on huge pages ({grown} KiB)"


def _huge_page_advised(address: int) -> bool:
    """Whether the mapping holding `address` carries MADV_HUGEPAGE ("hg" in its VmFlags)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    return False


class _Tied(nn.Module):
    """Weights that share storage in each way a decoder's do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 64)
        self.head = nn.Linear(64, 1000, bias=False)
        self.head.weight = self.embed.weight  # tied: one Parameter in two modules
        fused = torch.randn(96, 64)
        self.q = nn.Parameter(fused[:64], requires_grad=False)  # two views of one storage
        self.k = nn.Parameter(fused[64:], requires_grad=False)
        self.register_buffer("table", torch.randn(3, 5).t())  # strided
        self.packed = PackedLinear(nn.Linear(64, 40))


def test_weights_onto_huge_pages_keep_their_values_and_sharing():
    if not huge_pages_on():
        pytest.skip("transparent huge pages are off on this machine")
    model = _Tied()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    packed_before = model.packed.weight.data.clone()
    moved = weights_onto_huge_pages(model)
    assert moved >= sum(t.untyped_storage().nbytes() for t in before.values()) // 2
    for name, t in model.state_dict().items():
        assert torch.equal(t, before[name]), name
        assert t.stride() == before[name].stride(), name
        assert _huge_page_advised(t.data_ptr()), name
    assert torch.equal(model.packed.weight.data, packed_before)
    assert _huge_page_advised(model.packed.weight.data.data_ptr())
    assert model.head.weight is model.embed.weight
    assert model.q.untyped_storage().data_ptr() == model.k.untyped_storage().data_ptr()
    assert model.k.data_ptr() - model.q.data_ptr() == 64 * 64 * 4
    x = torch.randn(2, 64)
    unpacked = packed_before.transpose(1, 2).reshape(-1, 64)[:40]
    assert torch.equal(model.packed(x), F.linear(x, unpacked, model.packed.bias))


def test_a_cpu_engine_s_weights_are_on_huge_pages():
    if not huge_pages_on():
        pytest.skip("transparent huge pages are off on this machine")
    engine = LLMEngine(EngineConfig(model=tiny_model_dir(), device="cpu"))
    try:
        model = engine.runner.model
        tensors = list(model.parameters()) + list(model.buffers())
        tensors += [m.weight.data for m in model.modules() if isinstance(m, PackedLinear)]
        assert tensors and all(_huge_page_advised(t.data_ptr()) for t in tensors)
    finally:
        engine.close()
