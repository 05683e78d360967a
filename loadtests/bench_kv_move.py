"""Moving a sequence with its KV against computing its context again: what each part of a
move costs per KV block (export from the source's cache, the way to another process: Ray's
object store, or the replicas' direct link, engine/runner/kv_link.py, on its connection or a
p2p group; import into the target's cache) and the target's first step with the KV against
the same step computing the whole context, in the same run. Each way ends with the bytes
copied once in the other process, as the target's import copies them into its cache.

    python -m loadtests.bench_kv_move --model small --context 256 1024 [--json]

The source and the target are two engines in this process; the KV goes to a Ray actor in
another process each way, as it goes from one engine replica to another. Greedy tokens after
the move must equal the recomputing target's.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np
import ray
import torch

from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.core.request import Resume
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from engine.runner.kv_link import KVLink, KVOffer
from engine.runner.kv_transfer import on_host
from loadtests.workload import resolve_model

BLOCK_SIZE = 16


@ray.remote(num_cpus=0)
class Courier:
    """Another process that takes a KV, as a target replica does, and copies its bytes once
    (as the target's import into its cache does: the object store's get maps them without
    reading them)."""

    def __init__(self) -> None:
        self.link = KVLink("127.0.0.1", "courier")
        self.cache = np.empty(0, dtype=np.uint8)

    def carry(self, refs: list) -> int:
        (kv,) = ray.get(refs)
        return self._import(np.asarray(kv.data))

    def take(self, offer: KVOffer, p2p: bool) -> int:
        kv = self.link.fetch(offer, torch.device("cpu"), p2p=p2p)
        return self._import(np.asarray(kv.data))

    def _import(self, data: np.ndarray) -> int:
        if self.cache.size != data.size:
            self.cache = np.empty(data.size, dtype=np.uint8)
        np.copyto(self.cache, data.reshape(-1))
        return int(data.nbytes)

    def ping(self) -> int:
        return 0


def make_engine(model: str, args) -> LLMEngine:
    config = EngineConfig(
        model=model,
        device="cpu",
        dtype="float32",
        num_threads=args.threads,
        # No prefix cache: the recomputing request must not find the moved one's blocks.
        cache=CacheConfig(
            block_size=BLOCK_SIZE,
            kv_cache_bytes=args.kv_cache_mb << 20,
            enable_prefix_caching=False,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=max(args.context) + 16, max_model_len=2048
        ),
        overlap_steps=False,
    )
    return LLMEngine(config)


def first_step_s(engine: LLMEngine, request_id: str, prompt, params, resume) -> float:
    engine.add_prepared(engine.make_request(request_id, prompt, params, resume=resume))
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def finish(engine: LLMEngine, request_id: str) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
    return tokens


def one_context(source, target, courier, link: KVLink, n: int, args, rng) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = [rng.randrange(100, 16000) for _ in range(n)]
    empty_call = statistics.median(_timed(lambda: ray.get(courier.ping.remote())) for _ in range(5))
    rows = []
    for trial in range(args.trials):
        rid = f"c{n}-{trial}"
        source.add_prepared(source.make_request(rid, prompt, params))
        done: list[int] = []
        while len(done) < 2:  # the prompt and a decode step computed
            done += [t for o in source.step() if o.request_id == rid for t in o.new_token_ids]
        source.settle()
        t0 = time.perf_counter()
        kv = source.move_out([rid])[rid]
        t_export = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref = ray.put(on_host(kv))
        t_put = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert ray.get(courier.carry.remote([ref])) == kv.nbytes
        t_get = time.perf_counter() - t0 - empty_call
        t0 = time.perf_counter()
        ray.get(ref)  # here: zero-copy from the local store
        t_local_get = time.perf_counter() - t0
        offer = link.offer(kv)
        t_link = {}
        for way in ("host", "p2p"):
            t0 = time.perf_counter()
            assert ray.get(courier.take.remote(offer, way == "p2p")) == kv.nbytes
            t_link[way] = time.perf_counter() - t0 - empty_call
        link.withdraw(offer)
        moved = first_step_s(target, f"{rid}-kv", prompt, params, Resume(done, 0, kv))
        moved_tokens = finish(target, f"{rid}-kv")
        recomputed = first_step_s(target, f"{rid}-re", prompt, params, Resume(done, 0))
        assert finish(target, f"{rid}-re") == moved_tokens, "the move changed the tokens"
        rows.append((kv, t_export, t_put, t_get, t_local_get, moved, recomputed, *t_link.values()))
        del ref
    kv = rows[0][0]
    med = [statistics.median(r[i] for r in rows) for i in range(1, 9)]
    t_export, t_put, t_get, t_local_get, moved, recomputed, t_host, t_p2p = med
    blocks = kv.num_blocks
    mb = kv.nbytes / 2**20
    return {
        "context_tokens": kv.num_tokens,
        "blocks": blocks,
        "kv_mib": round(mb, 2),
        "bytes_per_block": kv.nbytes // blocks,
        "export_ms": round(1e3 * t_export, 2),
        "put_ms": round(1e3 * t_put, 2),
        "get_other_process_ms": round(1e3 * t_get, 2),
        "get_local_ms": round(1e3 * t_local_get, 3),
        "export_us_per_block": round(1e6 * t_export / blocks, 1),
        "object_store_us_per_block": round(1e6 * (t_put + t_get) / blocks, 1),
        "export_gib_s": round(mb / 1024 / t_export, 2),
        "put_get_gib_s": round(mb / 1024 / (t_put + t_get), 2),
        "link_host_ms": round(1e3 * t_host, 2),
        "link_p2p_ms": round(1e3 * t_p2p, 2),
        "link_host_us_per_block": round(1e6 * t_host / blocks, 1),
        "link_host_gib_s": round(mb / 1024 / t_host, 2),
        "link_p2p_gib_s": round(mb / 1024 / t_p2p, 2),
        "first_step_with_kv_ms": round(1e3 * moved, 1),
        "first_step_recompute_ms": round(1e3 * recomputed, 1),
        "move_total_ms": round(1e3 * (t_export + t_put + t_get + moved), 1),
        "recompute_over_move": round(recomputed / (t_export + t_put + t_get + moved), 2),
    }


def _timed(work) -> float:
    t0 = time.perf_counter()
    work()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--context", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kv-cache-mb", type=int, default=512)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    model = resolve_model(args.model)
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        courier = Courier.remote()
        ray.get(courier.ping.remote())
        source, target = make_engine(model, args), make_engine(model, args)
        rng = random.Random(0)
        link = KVLink("127.0.0.1", "source")
        results = [one_context(source, target, courier, link, n, args, rng) for n in args.context]
    finally:
        ray.shutdown()
        link.close()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for r in results:
        print(
            f"context {r['context_tokens']:5d} tokens, {r['blocks']} blocks of "
            f"{r['bytes_per_block'] / 1024:.0f} KiB ({r['kv_mib']} MiB): export "
            f"{r['export_ms']} ms ({r['export_gib_s']} GiB/s), object store put "
            f"{r['put_ms']} + get elsewhere {r['get_other_process_ms']} ms "
            f"({r['put_get_gib_s']} GiB/s, {r['object_store_us_per_block']} us/block); "
            f"link {r['link_host_ms']} ms on its connection ({r['link_host_gib_s']} GiB/s, "
            f"{r['link_host_us_per_block']} us/block), {r['link_p2p_ms']} ms p2p (gloo, "
            f"{r['link_p2p_gib_s']} GiB/s); "
            f"target's first step {r['first_step_with_kv_ms']} ms with the KV vs "
            f"{r['first_step_recompute_ms']} ms recomputing: a move (by the object store) costs "
            f"{r['move_total_ms']} ms, recompute/move {r['recompute_over_move']}x"
        )


if __name__ == "__main__":
    main()
