"""KV-aware routing's choice (cluster/prefix_routing.py): the replica holding the
longest prefix of the prompt, unless its load outweighs what it holds."""

from __future__ import annotations

from array import array

from cluster.prefix_routing import cached_prefix, kv_ranked
from engine.core.block_hashes import prompt_block_hashes
from serve_app.transport.cached_prefix import PublishedBlocks

PROMPT = list(range(1000, 1161))  # 10 full blocks of 16


def publish(keys: list[int]) -> bytes:
    return array("q", keys).tobytes()


def test_the_replica_holding_more_of_the_prompt_wins_until_its_load_outweighs_it():
    keys = prompt_block_hashes(PROMPT, 16)
    holds = {"a": frozenset(keys[:2]), "b": frozenset(keys[:8]), "c": frozenset()}
    loads = {"a": 1.0, "b": 4.0, "c": 0.0}

    def ranks(weight: float) -> list[list[str]]:
        return kv_ranked(["c", "a", "b"], keys, loads.get, holds.get, weight)

    # Scores at weight 8: a 1 - 1.6, b 4 - 6.4, c 0: b holds 80%, worth 6.4 requests.
    assert ranks(8.0) == [["b"], ["c", "a"]]
    # At weight 2: a 0.6, b 2.4, c 0: the idle one.
    assert ranks(2.0)[0] == ["c"]
    # A prompt shorter than a block: no preference, the ranking as it was.
    assert kv_ranked(["c", "a"], [], loads.get, holds.get, 8.0) == [["c", "a"]]
    # Only a prefix counts: the later blocks without the first are worth nothing.
    assert cached_prefix(keys, frozenset(keys[1:])) == 0
    assert cached_prefix(keys, frozenset(keys)) == 10


def test_published_keys_are_decoded_once_per_publication():
    published = PublishedBlocks()
    first = publish([5, 6, 7])
    held = published.held("r1", first)
    assert held == {5, 6, 7}
    assert published.held("r1", first) is held  # the same publication: not decoded again
    assert published.held("r1", publish([8])) == {8}
    assert published.held("r2", None) == frozenset()
    published.forget_others({"r2"})
    assert published.held("r1", first) == {5, 6, 7}  # decoded anew after being forgotten
