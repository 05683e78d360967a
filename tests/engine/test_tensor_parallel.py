"""Tensor parallelism on the CPU (gloo): N ranks in N processes give the tokens and logprobs
of one rank, also with steps launched ahead, each rank reads its share of the checkpoint, and
a dead rank fails its engine's requests with an error naming it."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from engine.core.errors import InvalidParam
from engine.core.sampling_params import SamplingParams
from engine.model.loader import read_spec
from engine.model.sharding import Shard
from engine.model.tiny_model import make_model
from engine.model.weight_loader import load_decoder
from tests.conftest import REPO, build_engine, tiny_model_dir
from tests.engine.test_oracle import random_prompts, run_mix, scenario_engine
from tests.engine.test_sequence_kv import GREEDY, move, move_swapped, run, tokens
from tests.engine.test_sequence_kv import engine as kv_engine


@pytest.fixture(scope="module")
def wide_model() -> str:
    """8 heads, 4 KV heads, 256 MLP columns: worlds of 2 and 4 divide it."""
    return str(make_model(REPO / "models" / "tiny-wide", size="tiny-wide"))


def _mix(
    model: str, scenario: str, world: int, seed: int = 0, **engine_args
) -> dict[int, list[int]]:
    engine = scenario_engine(model, scenario, tensor_parallel_size=world, **engine_args)
    try:
        rng = random.Random(seed)
        prompts = random_prompts(seed, 12, max_len=40)
        max_tokens = [rng.randint(1, 20) for _ in prompts]
        tokens = run_mix(engine, prompts, max_tokens, [rng.randint(0, 6) for _ in prompts])
        if engine_args.get("deferred_steps"):  # steps were launched ahead, as on a GPU
            assert engine.core.num_continuations > 5
        return tokens
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("arch", "world", "scenario"),
    [
        ("wide", 2, "roomy"),
        ("wide", 2, "chunked+preemption"),
        ("wide", 4, "chunked-prefill"),
        ("wide", 4, "preemption"),
        ("qwen2", 2, "chunked+preemption"),  # q/k/v biases, tied embeddings
        ("qwen3", 2, "preemption"),  # q/k norms
    ],
)
def test_greedy_tokens_equal_one_rank(wide_model, arch, world, scenario):
    model = wide_model if arch == "wide" else tiny_model_dir(arch)
    assert _mix(model, scenario, world) == _mix(model, scenario, 1)


@pytest.mark.parametrize(("world", "scenario"), [(2, "roomy"), (4, "chunked+preemption")])
def test_steps_launched_ahead_get_rank_0s_tokens_on_every_rank(wide_model, world, scenario):
    """Steps computed when collected, as on a GPU: a step launched before the one in flight
    is collected takes its input tokens from rank 0's sampled tokens by broadcast."""
    deferred = _mix(wide_model, scenario, world, deferred_steps=True)
    assert deferred == _mix(wide_model, scenario, 1)


@pytest.mark.parametrize("world", [2, 4])
def test_logprobs_within_1e_5_of_one_rank(wide_model, world):
    prompts = random_prompts(3, 6, max_len=30)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)

    def logprobs(tp: int) -> list[list[tuple[int, float]]]:
        engine = build_engine(wide_model, tensor_parallel_size=tp)
        try:
            entries = []
            for i, prompt in enumerate(prompts):
                engine.add_request(str(i), prompt, params)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    entries += [[(-1, e.logprob), *e.top] for e in out.logprobs or []]
            return entries
        finally:
            engine.close()

    one, many = logprobs(1), logprobs(world)
    assert len(one) == len(many) == 6 * 8
    for a, b in zip(one, many, strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True)) < 1e-5


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_reads_its_share_of_the_checkpoint(wide_model, world):
    spec = read_spec(wide_model)
    cpu = torch.device("cpu")
    whole = load_decoder(wide_model, spec, cpu, torch.float32, native_ops=False)
    for rank in range(world):
        part = load_decoder(
            wide_model, spec, cpu, torch.float32, native_ops=False, tp=_Sharded(rank, world)
        )
        share = part.loaded_bytes / whole.loaded_bytes
        assert abs(share - 1 / world) < 0.01, (rank, share)
        rows = spec.vocab_size // world
        vocab = slice(rank * rows, (rank + 1) * rows)
        torch.testing.assert_close(part.embed_tokens.weight, whole.embed_tokens.weight[vocab])
        cols = spec.num_heads * spec.head_dim // world
        torch.testing.assert_close(
            part.layers[1].self_attn.o_proj.weight,
            whole.layers[1].self_attn.o_proj.weight[:, rank * cols : (rank + 1) * cols],
        )
        inter = spec.intermediate_size // world
        torch.testing.assert_close(
            part.layers[0].mlp.down_proj.weight,
            whole.layers[0].mlp.down_proj.weight[:, rank * inter : (rank + 1) * inter],
        )


class _Sharded:
    """What the loader reads of a TensorParallel: only its shard (loading runs no collective)."""

    def __init__(self, rank: int, world: int) -> None:
        self.shard = Shard(rank, world)


def test_a_world_the_model_does_not_divide_names_the_field(tiny_model):
    with pytest.raises(
        InvalidParam,
        match="tensor_parallel_size .4. must divide the model's num_key_value_heads .2.",
    ):
        build_engine(tiny_model, tensor_parallel_size=4)


def test_a_dead_rank_fails_the_step_naming_it(wide_model):
    engine = build_engine(wide_model, tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        engine.add_request("a", [5, 6, 7], params)
        engine.step()
        assert engine.runner.health_problem() is None
        worker = engine.runner.workers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        outputs = engine.step()
        assert [o.finish_reason for o in outputs] == ["error"]
        assert "tensor-parallel rank 1" in outputs[0].error
        assert f"pid {worker.pid}" in engine.runner.health_problem()
        kv = engine.scheduler.kv_cache
        assert kv.num_free_blocks == kv.num_blocks
        started = time.monotonic()
        engine.add_request("b", [8, 9], params)  # fails at once too, never hangs
        assert engine.step()[0].finish_reason == "error"
        assert time.monotonic() - started < 10
    finally:
        engine.close()


def test_ranks_end_with_the_engine_process(wide_model):
    """A SIGKILLed engine process (as Serve stops a replica) leaves no rank running."""
    script = (
        "import sys, time\n"
        "from tests.conftest import build_engine\n"
        f"engine = build_engine({wide_model!r}, tensor_parallel_size=2)\n"
        "print(*(p.pid for p in engine.runner.workers.processes), flush=True)\n"
        "time.sleep(600)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    engine = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO
    )
    try:
        ranks = [int(pid) for pid in engine.stdout.readline().split()]
        assert len(ranks) == 1 and all(_alive(pid) for pid in ranks)
    finally:
        engine.kill()
        engine.wait()
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in ranks):
        assert time.monotonic() < deadline, "ranks outlived their engine"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_ranks_share_the_replicas_kv_cache_bytes(wide_model):
    """Each of N ranks holds 1/N of every block, so the same budget gives the same blocks."""
    from engine.core.config import CacheConfig, EngineConfig
    from engine.runner.torch_runner import TorchModelRunner

    blocks = []
    for world in (1, 2):
        cache = CacheConfig(kv_cache_bytes=4 << 20)
        runner = TorchModelRunner(
            EngineConfig(model=wide_model, tensor_parallel_size=world, cache=cache)
        )
        blocks.append(runner.num_kv_blocks())
        runner.close()
    assert blocks[0] == blocks[1] > 0


def test_embeddings_within_1e_5_of_one_rank(wide_model):
    """Embedding rows beside generating ones: every rank runs the same pooled forward (its
    collectives), rank 0's vectors are one rank's."""
    from tests.engine.test_embeddings import embed

    prompts = random_prompts(5, 4, max_len=40)
    vectors = {}
    for world in (1, 2):
        engine = build_engine(wide_model, tensor_parallel_size=world, max_num_batched_tokens=16)
        try:
            params = SamplingParams(max_tokens=1, pooling="mean")
            vectors[world], _ = embed(engine, prompts, params, prompts[:2])
        finally:
            engine.close()
    for rid, vector in vectors[1].items():
        assert torch.allclose(vectors[2][rid], vector, atol=1e-5, rtol=0), rid


@pytest.mark.parametrize(("source_world", "target_world"), [(2, 2), (2, 1), (1, 2)])
def test_a_sequence_moves_with_its_kv_whatever_the_ranks_at_either_end(
    wide_model, source_world, target_world
):
    """Rank 0 gathers every head of a moving sequence's blocks from the ranks; each rank of
    the target writes its share: it goes on exactly, its context not computed again."""
    source = kv_engine(wide_model, tensor_parallel_size=source_world)
    target = kv_engine(wide_model, tensor_parallel_size=target_world)
    try:
        whole = run(source, "whole", GREEDY)
        before, after, kv, computed = move(source, target, "r", GREEDY, steps=3)
        assert kv is not None and kv.data.shape[4] == 4  # every KV head of the model
        assert tokens(before) + tokens(after) == tokens(whole)
        assert computed == [1] * len(tokens(after))
        assert target.num_kv_refused == 0
    finally:
        source.close()
        target.close()


def test_fp8_kv_of_tensor_parallel_ranks_stays_and_is_computed_again(wide_model):
    """Each rank measures its own FP8 scales: the KV does not leave, and the target computes
    the context (the tokens are the same)."""
    fp8 = {"kv_cache_dtype": "fp8_e4m3", "calculate_kv_scales": True}
    source = kv_engine(wide_model, tensor_parallel_size=2, **fp8)
    target = kv_engine(wide_model, **fp8)
    try:
        whole = run(source, "whole", GREEDY)
        before, after, kv, computed = move(source, target, "r", GREEDY, steps=3)
        assert kv is None
        assert len(tokens(before) + tokens(after)) == len(tokens(whole))
        assert sum(computed) > len(tokens(after))  # its context computed here
    finally:
        source.close()
        target.close()


def test_a_swapped_sequence_of_tensor_parallel_ranks_moves_from_their_host_pools(wide_model):
    target = kv_engine(wide_model)
    try:
        move_swapped(wide_model, target, tensor_parallel_size=2)
    finally:
        target.close()
