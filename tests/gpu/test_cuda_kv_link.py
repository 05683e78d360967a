"""A sequence's KV moved between engines on CUDA over the replicas' direct link
(engine/runner/kv_link.py; skipped without CUDA): exported where the cache is, taken device
to device over NCCL where the two ends are on two GPUs, else (NCCL refuses two ranks on one
GPU) through the host on the link's connection after the p2p attempt fails; either way the
sequence goes on token-exact without computing its context."""

from __future__ import annotations

import time

import pytest
import torch

from engine.core.request import Resume
from engine.runner.kv_link import KVLink
from tests.conftest import build_engine
from tests.engine.test_sequence_kv import GREEDY, SEEDED, assert_no_block_held, run, text, tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def cuda_engine(model: str, device: str):
    return build_engine(model, 16, 64, device=device, max_num_seqs=4, max_num_batched_tokens=256)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_kv_moves_between_cuda_engines_over_the_link(tiny_model, params):
    two_gpus = torch.cuda.device_count() >= 2
    source = cuda_engine(tiny_model, "cuda")
    target = cuda_engine(tiny_model, "cuda:1" if two_gpus else "cuda")
    whole = run(source, "whole", params)
    before = run(source, "r", params, steps=3) + source.settle()
    kv = source.move_out(["r"])["r"]
    assert kv.data.is_cuda  # exported where the cache is
    sender, taker = KVLink("127.0.0.1", "source", 20.0), KVLink("127.0.0.1", "target", 20.0)
    try:
        offer = sender.offer(kv)
        assert offer.device == "cuda"
        started = time.perf_counter()
        taken = taker.fetch(offer, target.runner.device)
        took = time.perf_counter() - started
        way = "p2p" if two_gpus else "host"
        print(f"{kv.nbytes / 2**20:.2f} MiB of KV by {way} in {took * 1e3:.1f} ms")
        assert taker.num_taken[way] == 1
        assert taker.num_p2p_failures == (0 if two_gpus else 1)
        assert torch.equal(torch.as_tensor(taken.data).to(kv.data.device), kv.data)
    finally:
        sender.close()
        taker.close()
    computed: list[int] = []
    launch = target.runner.launch
    target.runner.launch = lambda out: computed.append(out.num_batched_tokens) or launch(out)
    resume = Resume(tokens(before), len(text(before)), taken)
    after = run(target, "r", params, resume=resume)
    assert tokens(before) + tokens(after) == tokens(whole)
    assert computed == [1] * len(tokens(after))  # its context came with it
    assert target.num_kv_refused == 0
    assert_no_block_held(target)
