"""The prefix cache's key of a full block of tokens: the chained hash of (its parent block's
key, its tokens), the first block's parent being its request's cache salt (BASE_SALT for the
base model, a LoRA adapter's own otherwise).

Python hashes ints and tuples of ints alike in every process (None, str and bytes it does
not: None's hash is its address before 3.12), so a router computes from a prompt's token ids
the keys an engine replica publishes for the blocks it holds.
"""

from __future__ import annotations

BASE_SALT = 0


def block_hash(parent: object, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


def prompt_block_hashes(
    token_ids: list[int], block_size: int, salt: object = BASE_SALT
) -> list[int]:
    """The keys of the full blocks of `token_ids` a prefix-cache hit can cover, in order (the
    last token is always computed: its logits are sampled)."""
    hashes: list[int] = []
    parent = salt
    for i in range((len(token_ids) - 1) // block_size):
        parent = block_hash(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        hashes.append(parent)
    return hashes
