"""The keys an engine publishes for the prompt blocks its prefix cache holds are the ones any
process computes from the prompt's token ids (engine/core/block_hashes.py): KV-aware routing
rests on it."""

from __future__ import annotations

import ast
import subprocess
import sys
from array import array

from engine.core.block_hashes import prompt_block_hashes
from engine.core.sampling_params import SamplingParams
from tests.conftest import build_engine

PROMPT = list(range(300, 339))  # 39 tokens: 9 full blocks of 4 before the last token


def published(engine) -> list[int]:
    keys = array("q")
    keys.frombytes(engine.cached_blocks(1000))
    return list(keys)


def test_the_published_keys_are_the_prompts_own_in_any_process(tiny_model):
    engine = build_engine(tiny_model, 4, 100)
    engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1))
    keys = prompt_block_hashes(PROMPT, 4)
    assert len(keys) == 9
    assert set(keys) <= set(published(engine))
    code = f"from engine.core.block_hashes import prompt_block_hashes as h;print(h({PROMPT}, 4))"
    elsewhere = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert ast.literal_eval(elsewhere) == keys  # another interpreter, another address space
    # The most recent first, at most the limit.
    assert len(array("q", engine.cached_blocks(3))) == 3


def test_an_adapter_request_blocks_have_other_keys(tiny_model):
    from tests.lora_adapters import lora_adapters

    adapters = lora_adapters(tiny_model)
    engine = build_engine(tiny_model, 4, 100, lora={"adapters": adapters, "max_loras": 1})
    name = next(iter(adapters))
    engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1), loras=[name])
    assert not set(prompt_block_hashes(PROMPT, 4)) & set(published(engine))
