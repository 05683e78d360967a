"""The token ids that end a model's generation."""

from __future__ import annotations


def eos_token_ids(model: str, tokenizer) -> tuple[int, ...]:
    """EOS ids from generation_config.json (may list several), else the tokenizer's."""
    ids: list[int] = []
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model).eos_token_id
        if eos is not None:
            ids = list(eos) if isinstance(eos, list | tuple) else [eos]
    except OSError:
        pass
    if not ids and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return tuple(ids)
