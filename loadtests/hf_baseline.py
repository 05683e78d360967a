"""The HF baseline of the engine benchmark: transformers' `generate` in static batches."""

from __future__ import annotations

import time

import torch

from loadtests.cpu_accounting import StealMeter
from loadtests.workload import WorkItem


def run_hf_static(model_dir: str, items: list[WorkItem], batch_size: int, args) -> dict:
    """HF generate in static batches with left padding; counts each request's own tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    pad = model.generation_config.pad_token_id or 0
    produced = 0
    with StealMeter() as steal:
        start = time.perf_counter()
        for b in range(0, len(items), batch_size):
            batch = items[b : b + batch_size]
            width = max(len(it.prompt_token_ids) for it in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, it in enumerate(batch):
                n = len(it.prompt_token_ids)
                ids[i, width - n :] = torch.tensor(it.prompt_token_ids)
                mask[i, width - n :] = 1
            with torch.no_grad():
                out = model.generate(
                    ids.to(args.device),
                    attention_mask=mask.to(args.device),
                    do_sample=False,
                    max_new_tokens=max(it.max_tokens for it in batch),
                    eos_token_id=None,
                    pad_token_id=pad,
                )
            out.cpu()  # wait for the device
            produced += sum(it.max_tokens for it in batch)
        wall = time.perf_counter() - start
    return {"tok_s": produced / wall, "wall_s": wall, "steal_frac": steal.fraction}
