"""The benchmark workload's chat items: as long as asked, whatever the tokenizer."""

from __future__ import annotations

from engine.model.tiny_model import padded_tokenizer
from loadtests.workload import as_chat, load_workload


def test_chat_items_fit_their_prompt_length_with_a_padded_vocabulary(tmp_path):
    # A real model's vocabulary over the tiny models' BPE: random ids past the trained ones
    # decode to several characters each, which re-encode into several tokens.
    padded_tokenizer(32768).save_pretrained(tmp_path)
    items = load_workload("random-64-8-6", vocab_size=32768)
    chats = as_chat(items, str(tmp_path))
    for item, chat in zip(items, chats, strict=True):
        assert len(item.prompt_token_ids) // 2 < len(chat.prompt_token_ids)
        assert len(chat.prompt_token_ids) <= len(item.prompt_token_ids)
        assert chat.chat and chat.max_tokens == item.max_tokens
