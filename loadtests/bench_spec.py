"""Speculative decoding's speedup against acceptance, and the adaptive off-switch at large
batches, on the real engine; speculation off is measured in the same run.

    python -m loadtests.bench_spec [--model small] [--batches 1,8,32,128]
        [--acceptances 1,0.8,0.6,0.3,0] [--k 4] [--max-tokens 64] [--repeat 2]
        [--draft DIR] [--json]

Random-weight models say little about real acceptance, so the drafts come from an oracle
(engine/core/fixed_proposers.ReplayProposer): each request's own greedy output, decoded first
without speculation, with a set share of the drafted tokens corrupted. For each batch size
and acceptance: decode tokens/s and the median time per output token (TPOT) of the decode
phase (after every request has its first token), without speculation and with it, adaptive
drafting on (`--repeat` such pairs; figures are their medians; one speculator serves a batch
size's runs, as a replica's would, so it probes step sizes once).

On a device whose steps are synchronous (the CPU) a pair runs in lockstep: two engines of the
same checkpoint, one without speculation and one with it, take a step each in turn, and each
run's figures count only its own steps' time, so the host's drift falls on both alike; the
engines swap roles from pair to pair, so neither instance's memory layout favours one side.
Each batch size first runs both engines without speculation in lockstep: that ratio (`noise`,
per batch size) is what the measurement itself scatters by (a process contending for the
cores shows there: it does not fall on both alike). On
a GPU, where steps stay in flight across calls, a pair's runs take turns on one engine
(off-on, then on-off).

Then the ngram proposer on prompts that quote the model (X, its own greedy continuation of
X, X again), with the acceptance it got; the ngram proposer again on a tiny model trained to
copy its context (loadtests/copy_model.py, trained once into models/tiny-copy) and prompts
that repeat a block, where prompt lookup finds what the model says; and with `--draft DIR` a
draft-model proposer on random prompts. With --json the output ends with one JSON object
holding `noise` (per batch size, off against off in lockstep), `worst_speedup` (per batch
size, the least speedup over the acceptances: what speculation can cost there),
`speedup_batch1_acc08`, `speedup_batch128` (that least at batch 128) and
`requests_changed_total` (requests whose greedy tokens changed with speculation in any run:
0 unless a near-tie rounded the other way).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.core.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from engine.core.fixed_proposers import ReplayProposer
from engine.core.outputs import SpecDecodeStats
from engine.core.sampling_params import SamplingParams
from engine.core.speculator import Speculator
from engine.llm_engine import LLMEngine
from engine.runner.draft_proposer import step_token_tile
from loadtests.copy_model import COPY_PERIOD, copy_model, copy_prompts
from loadtests.workload import REPO, resolve_model


def _engine(model: str, args, max_batch: int) -> LLMEngine:
    spec = SpeculativeConfig(enabled=True, num_speculative_tokens=args.k)
    return LLMEngine(
        EngineConfig(
            model=model,
            device=args.device,
            dtype=args.dtype,
            cache=CacheConfig(block_size=16, kv_cache_bytes=int(args.kv_cache_gb * 2**30)),
            scheduler=SchedulerConfig(
                max_num_seqs=max_batch,
                max_num_batched_tokens=max(2048, max_batch * (args.k + 1)),
                # The longest: the ngram stage's prompts (X, C, X) and their output (C again).
                max_model_len=2 * args.prompt_len + 2 * args.max_tokens + 16,
            ),
            speculative=spec,
        )
    )


Engines = tuple[LLMEngine, LLMEngine]


def _engines(model: str, args, max_batch: int) -> Engines:
    """Two engines of the checkpoint where steps are synchronous (pairs run in lockstep);
    elsewhere one, twice (a pair's runs take turns on it)."""
    first = _engine(model, args, max_batch)
    if args.device != "cpu":
        return first, first
    return first, _engine(model, args, max_batch)


def _distinct(engines: Engines) -> list[LLMEngine]:
    return list(dict.fromkeys(engines))


def _close(engines: Engines) -> None:
    for engine in _distinct(engines):
        engine.close()


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(batch)]


@dataclass
class _Phase:
    """One engine's run of a batch of prompts, timed by its own steps only."""

    engine: LLMEngine
    ids: list[str]
    tokens: dict[str, list[int]] = field(default_factory=dict)
    first: dict[str, float] = field(default_factory=dict)
    last: dict[str, float] = field(default_factory=dict)
    clock: float = 0.0  # seconds spent in this engine's steps
    start: float | None = None  # the clock when every request had its first token

    def step(self) -> None:
        began = time.perf_counter()
        outputs = self.engine.step()
        self.clock += time.perf_counter() - began
        for out in outputs:
            self.tokens[out.request_id] += out.new_token_ids
            self.first.setdefault(out.request_id, self.clock)
            self.last[out.request_id] = self.clock
        if self.start is None and len(self.first) == len(self.ids):
            self.start = self.clock

    def figures(self) -> dict:
        decoded = sum(len(t) - 1 for t in self.tokens.values())
        tpot = [
            (self.last[r] - self.first[r]) / (len(self.tokens[r]) - 1)
            for r in self.ids
            if len(self.tokens[r]) > 1
        ]
        return {
            "tokens": self.tokens,
            "tokens_per_s": decoded / (max(self.last.values()) - self.start),
            "tpot_ms": statistics.median(tpot) * 1e3,
        }


def decode_phases(
    runs: list[tuple[LLMEngine, list[list[int]], str]], max_tokens: int
) -> list[dict]:
    """Each engine runs its prompts together, the engines a step each in turn (distinct
    engines: a run's steps see the host as the others' do); per run, tokens/s and TPOT of
    the phase after every first token, on the clock of its own steps."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    phases = []
    for engine, prompts, tag in runs:
        phase = _Phase(engine, [f"{tag}-{i}" for i in range(len(prompts))])
        for rid, prompt in zip(phase.ids, prompts, strict=True):
            engine.add_request(rid, prompt, params)
            phase.tokens[rid] = []
        phases.append(phase)
    while busy := [p for p in phases if p.engine.has_unfinished_requests()]:
        for phase in busy:
            phase.step()
    return [phase.figures() for phase in phases]


def decode_phase(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str) -> dict:
    """Run the prompts together; tokens/s and TPOT of the phase after every first token."""
    return decode_phases([(engine, prompts, tag)], max_tokens)[0]


def off_and_on_phases(
    engines: Engines,
    prompts: list[list[int]],
    speculator: Speculator,
    max_tokens: int,
    tag: str,
    swap: bool = False,
) -> tuple[dict, dict]:
    """The prompts without speculation and with `speculator`: on two engines in lockstep
    (`swap`: the second engine runs without), or on one, off then on (`swap`: on then
    off)."""
    off_engine, on_engine = engines[::-1] if swap else engines
    if off_engine is not on_engine:
        _with(off_engine, None)
        _with(on_engine, speculator)
        off, on = decode_phases(
            [(off_engine, prompts, f"off-{tag}"), (on_engine, prompts, f"on-{tag}")], max_tokens
        )
        return off, on
    runs = [(None, f"off-{tag}"), (speculator, f"on-{tag}")]
    found = {
        run_tag: decode_phase(_with(off_engine, spec), prompts, max_tokens, run_tag)
        for spec, run_tag in (runs[::-1] if swap else runs)
    }
    return found[f"off-{tag}"], found[f"on-{tag}"]


def _with(engine: LLMEngine, speculator: Speculator | None) -> LLMEngine:
    engine.scheduler.speculator = speculator
    return engine


def run_batch(engines: Engines, batch: int, args, vocab: int) -> tuple[dict, float | None]:
    """Per acceptance, `--repeat` pairs of runs, speculation off and on (the second of each
    two swapped: roles in lockstep, order in turns); the figures are the pairs' medians.
    With them, the off-against-off ratio of two lockstep engines (None with one engine)."""
    prompts = _prompts(batch, args.prompt_len, vocab, seed=batch)
    # Without speculation first (on both engines where there are two): the greedy outputs
    # the drafts replay, the batch size's warm-up, and the measurement's own scatter.
    refs = [(_with(e, None), prompts, f"ref-{batch}-{i}") for i, e in enumerate(_distinct(engines))]
    ref = decode_phases(refs, args.max_tokens)
    noise = ref[1]["tokens_per_s"] / ref[0]["tokens_per_s"] if len(ref) == 2 else None
    outputs = list(ref[0]["tokens"].values())
    # One speculator for the batch size's runs, as a replica keeps its own: its step-time
    # measurements, acceptance history and ledger carry over (its first steps probe once,
    # not once a run); each run gets a proposer and counters of its own.
    warm = Speculator(engines[0].config.speculative, token_tile=step_token_tile(engines[0].runner))
    rows = {}
    for acceptance in args.acceptances:
        pairs = []
        for round_ in range(args.repeat):
            tag = f"{batch}-{acceptance}-{round_}"
            drafts = {f"on-{tag}-{i}": tokens for i, tokens in enumerate(outputs)}
            speculator = _rewarmed(warm, ReplayProposer(drafts, acceptance, vocab))
            steps_before = speculator.num_steps
            off, on = off_and_on_phases(
                engines, prompts, speculator, args.max_tokens, tag, swap=round_ % 2 == 1
            )
            steps = max(1, speculator.num_steps - steps_before)
            on["drafts_per_step"] = speculator.stats.num_draft_tokens / steps
            on["changed"] = _changed(engines[0], prompts, off, on)
            pairs.append((off, on, speculator.stats))
        med = statistics.median
        stats = [st for _, _, st in pairs]
        rows[str(acceptance)] = {
            "tokens_per_s_off": med(off["tokens_per_s"] for off, _, _ in pairs),
            "tpot_ms_off": med(off["tpot_ms"] for off, _, _ in pairs),
            "tokens_per_s": med(on["tokens_per_s"] for _, on, _ in pairs),
            "tpot_ms": med(on["tpot_ms"] for _, on, _ in pairs),
            "speedup": med(on["tokens_per_s"] / off["tokens_per_s"] for off, on, _ in pairs),
            "acceptance_measured": stats[0].acceptance_rate,
            "draft_tokens_per_step": med(on["drafts_per_step"] for _, on, _ in pairs),
            "steps_off": stats[0].num_steps_off,
            "requests_changed": sum(len(on["changed"]) for _, on, _ in pairs),
            "near_ties": [tie for _, on, _ in pairs for tie in on["changed"]],
            **_step_times(warm, batch),
        }
    return rows, noise


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def _step_times(speculator: Speculator, batch: int) -> dict:
    """What the adaptive rule decides from, as the speculator has measured it so far: a
    plain step of `batch` rows and the cheapest drafted one (one draft more)."""
    times = speculator.times
    plain = times.plain_seconds(batch) * 1e3 if times.plain.num_bands else None
    drafted = times.drafted_seconds(batch + 1) * 1e3 if times.ready else None
    return {"plain_step_ms": plain, "drafted_step_ms": drafted}


def _rewarmed(speculator: Speculator, proposer) -> Speculator:
    """`speculator` with a new proposer and fresh counters (its measurements, its ledger and
    its step count kept)."""
    speculator.proposer = proposer
    speculator.stats = SpecDecodeStats(accepted_per_position=[0] * speculator.k_max)
    return speculator


def _changed(engine: LLMEngine, prompts: list[list[int]], off: dict, on: dict) -> list[dict]:
    """Requests whose tokens differ with speculation (greedy: none should; a drafted
    position's logits come from another kernel path than a decode's, so a near-tie could
    round the other way, as between chunked prefill and decode). Each is reported with where
    it first differs and the margin there between the reference's two best logits
    (transformers, float32): a near-tie has a margin at float rounding's scale, a bug does
    not. Counted, not raised: the JSON's `requests_changed_total` sums them."""
    changed = []
    pairs = zip(off["tokens"].values(), on["tokens"].values(), strict=True)
    for i, (plain, drafted) in enumerate(pairs):
        if plain != drafted:
            at = next(
                (j for j, (a, b) in enumerate(zip(plain, drafted, strict=False)) if a != b), None
            )
            at = min(len(plain), len(drafted)) if at is None else at
            margin = _logit_margin(engine.config.model, tuple(prompts[i] + plain[:at]))
            changed.append({"request": i, "position": at, "logit_margin": margin})
    return changed


@functools.cache
def _reference(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


# A larger float32 reference would take the host minutes to load and run.
MARGIN_MODEL_BYTES = 2 << 30


def _logit_margin(model_dir: str, tokens: tuple[int, ...]) -> float | None:
    """None where the checkpoint is too large for a reference on the host."""
    weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    if weights > MARGIN_MODEL_BYTES:
        return None
    with torch.no_grad():
        logits = _reference(model_dir)(torch.tensor([tokens])).logits[0, -1]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def _quoting_prompts(engine: LLMEngine, batch: int, args, vocab: int) -> list[list[int]]:
    """Prompts that quote what the model says: X, the model's own greedy continuation C of X,
    then X again; a model that repeats itself says C again, which prompt lookup finds."""
    heads = _prompts(batch, args.prompt_len, vocab, seed=99 + batch)
    said = decode_phase(_with(engine, None), heads, args.max_tokens, f"quote-{batch}")
    return [x + c + x for x, c in zip(heads, said["tokens"].values(), strict=True)]


def off_and_on(engines: Engines, prompts, speculator: Speculator, args, tag: str) -> dict:
    """The prompts without speculation and with `speculator`: speedup and acceptance."""
    off, on = off_and_on_phases(engines, prompts, speculator, args.max_tokens, tag)
    changed = _changed(engines[0], prompts, off, on)
    return {
        "batch": len(prompts),
        "requests_changed": len(changed),
        "near_ties": changed,
        "speedup": on["tokens_per_s"] / off["tokens_per_s"],
        "tokens_per_s_off": off["tokens_per_s"],
        "tokens_per_s_on": on["tokens_per_s"],
        "acceptance": speculator.stats.acceptance_rate,
        "draft_tokens": speculator.stats.num_draft_tokens,
    }


def run_ngram(engines: Engines, batch: int, args, vocab: int) -> dict:
    prompts = _quoting_prompts(engines[0], batch, args, vocab)
    on_engine = engines[1]
    speculator = Speculator(
        on_engine.config.speculative, token_tile=step_token_tile(on_engine.runner)
    )
    return off_and_on(engines, prompts, speculator, args, f"ngram-{batch}")


def _warm_up(engines: Engines, prompts: list[list[int]]) -> None:
    decode_phases(
        [(_with(e, None), prompts, f"warm-up-{i}") for i, e in enumerate(_distinct(engines))], 8
    )


def run_ngram_copy(args) -> list[dict]:
    """`method: ngram` on a model that copies its context (loadtests/copy_model.py), on
    prompts that repeat a block: what prompt lookup gives where text repeats."""
    model = copy_model(args.copy_dir or REPO / "models" / "tiny-copy", args.copy_steps)
    batches = [int(x) for x in args.ngram_batches.split(",")]
    engines = _engines(model, args, max(batches))
    _warm_up(engines, copy_prompts(2, 16, seed=1))
    rows = []
    for batch in batches:
        prompts = copy_prompts(batch, 2 * COPY_PERIOD, seed=batch)
        speculator = Speculator(
            engines[1].config.speculative, token_tile=step_token_tile(engines[1].runner)
        )
        rows.append(off_and_on(engines, prompts, speculator, args, f"copy-{batch}"))
    _close(engines)
    return rows


def run_draft(engines: Engines, draft: str, batch: int, args, vocab: int) -> dict:
    """The draft-model proposer (`--draft DIR`) against speculation off, on random prompts."""
    from engine.runner.draft_proposer import DraftModelProposer

    prompts = _prompts(batch, args.prompt_len, vocab, seed=7 + batch)
    on_engine = engines[1]
    config = replace(on_engine.config.speculative, method="draft_model", model=draft)
    proposer = DraftModelProposer(
        replace(on_engine.config, speculative=config), on_engine.runner, on_engine.tokenizer
    )
    speculator = Speculator(config, proposer, token_tile=step_token_tile(on_engine.runner))
    return off_and_on(engines, prompts, speculator, args, f"draft-{batch}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="tiny, small, or a checkpoint dir")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--acceptances", default="1,0.8,0.6,0.3,0")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ngram-batches", default="1,8")
    parser.add_argument("--draft", default=None, help="a draft checkpoint: draft_model rows")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-gb", type=float, default=2.0)
    parser.add_argument("--repeat", type=int, default=2, help="off/on pairs; medians")
    parser.add_argument("--copy-steps", type=int, default=500, help="the copy model's training")
    parser.add_argument("--copy-dir", default=None, help="default: models/tiny-copy")
    parser.add_argument("--no-copy", action="store_true", help="skip ngram on the copy model")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.acceptances = [float(a) for a in args.acceptances.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    model = resolve_model(args.model)
    engines = _engines(model, args, max(batches))
    vocab = engines[0].runner_vocab_size()
    _warm_up(engines, _prompts(2, 16, vocab, 0))
    result: dict = {"model": args.model, "device": args.device, "k": args.k, "batches": {}}
    result["noise"] = {}
    for batch in batches:
        rows, result["noise"][str(batch)] = run_batch(engines, batch, args, vocab)
        result["batches"][str(batch)] = rows
        if result["noise"][str(batch)] is not None:
            print(f"batch {batch:4d}  off against off (the measurement's scatter): "
                  f"x{result['noise'][str(batch)]:.3f}", flush=True)  # fmt: skip
        for name, row in rows.items():
            measured = row["acceptance_measured"]
            print(
                f"batch {batch:4d}  acceptance {name:>4}: off {row['tokens_per_s_off']:8.1f} "
                f"tok/s (TPOT {row['tpot_ms_off']:6.2f} ms), on {row['tokens_per_s']:8.1f} "
                f"tok/s (TPOT {row['tpot_ms']:6.2f} ms)  x{row['speedup']:.2f}  "
                f"accepted {'-' if measured is None else f'{measured:.2f}'}, "
                f"{row['draft_tokens_per_step']:.1f} drafts/step, "
                f"{row['requests_changed']} requests changed; step {_ms(row['plain_step_ms'])} "
                f"plain, {_ms(row['drafted_step_ms'])} drafted",
                flush=True,
            )
    result["ngram"] = [run_ngram(engines, b, args, vocab) for b in
                       (int(x) for x in args.ngram_batches.split(","))]  # fmt: skip
    for row in result["ngram"]:
        print(f"ngram batch {row['batch']}: x{row['speedup']:.2f}, acceptance "
              f"{row['acceptance']}", flush=True)  # fmt: skip
    if not args.no_copy:
        result["ngram_copy"] = run_ngram_copy(args)
        for row in result["ngram_copy"]:
            print(f"ngram on the copy model, batch {row['batch']}: x{row['speedup']:.2f}, "
                  f"acceptance {row['acceptance']}", flush=True)  # fmt: skip
    if args.draft:
        result["draft_model"] = [run_draft(engines, args.draft, b, args, vocab) for b in
                                 (int(x) for x in args.ngram_batches.split(","))]  # fmt: skip
        for row in result["draft_model"]:
            print(f"draft_model batch {row['batch']}: x{row['speedup']:.2f}, acceptance "
                  f"{row['acceptance']}", flush=True)  # fmt: skip
    by_batch = result["batches"]
    # Per batch size, the least speedup over the acceptances: what speculation can cost there.
    result["worst_speedup"] = {
        b: min(row["speedup"] for row in rows.values()) for b, rows in by_batch.items()
    }
    if "1" in by_batch and "0.8" in by_batch["1"]:
        result["speedup_batch1_acc08"] = by_batch["1"]["0.8"]["speedup"]
    if "128" in by_batch:
        result["speedup_batch128"] = result["worst_speedup"]["128"]
    every_run = [row for rows in by_batch.values() for row in rows.values()]
    every_run += [
        row for key in ("ngram", "ngram_copy", "draft_model") for row in result.get(key, [])
    ]
    result["requests_changed_total"] = sum(row["requests_changed"] for row in every_run)
    _close(engines)
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
