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
    assert set(held.published) == {5, 6, 7} and 5 in held and 8 not in held
    # The same publication: not decoded again.
    assert published.held("r1", first).published is held.published
    assert 8 in published.held("r1", publish([8])) and 5 not in published.held("r1", None)
    assert not published.held("r2", None).published
    published.forget_others({"r2"})
    assert published.held("r1", first).published == {5, 6, 7}  # decoded anew when forgotten


def test_a_prompt_sent_to_a_replica_counts_as_held_there_until_it_would_have_published_it():
    now = [100.0]
    published = PublishedBlocks(horizon_s=3.0, clock=lambda: now[0])
    system = list(range(2000, 2096))  # 6 blocks every conversation starts with
    first, second, third = ([*system, *range(k, k + 64)] for k in (3000, 4000, 5000))
    loads = {"a": 1.0, "b": 0.0}
    # a has published the system prompt (one conversation); b was sent another conversation
    # a moment ago, and has not published yet.
    stats = {"a": publish(prompt_block_hashes(first, 16)), "b": None}
    published.sent("b", prompt_block_hashes(second, 16))

    def choice() -> str:
        keys = prompt_block_hashes(third, 16)
        held = lambda r: published.held(r, stats[r])  # noqa: E731
        return kv_ranked(["a", "b"], keys, lambda r: loads[r], held, 8.0)[0][0]

    assert choice() == "b"  # both hold the system prompt: the less loaded one
    now[0] += 3.5  # b would have published it by now, and has not: a holds more
    assert choice() == "a"
    # Sent again: held again, and resent keys are not dropped with the first sending's.
    published.sent("b", prompt_block_hashes(second, 16))
    now[0] += 2.0
    published.sent("b", prompt_block_hashes(system, 16))
    now[0] += 2.0
    assert all(k in published.held("b", None) for k in prompt_block_hashes(system, 16))
    assert choice() == "b"
    published.forget_others({"a"})
    assert choice() == "a"


def test_a_shared_prefix_draws_new_prompts_only_while_its_holders_cache_has_room():
    keys = prompt_block_hashes(PROMPT, 16)
    holds = {"a": frozenset(keys[:6]), "b": frozenset()}  # a holds the shared 60%
    loads = {"a": 0.0, "b": 0.0}

    def choice(fills: dict[str, float]) -> str:
        return kv_ranked(["a", "b"], keys, loads.get, holds.get, 8.0, fills.get)[0][0]

    # Scores: a 8 * (fill - 0.6), b 8 * fill.
    assert choice({"a": 0.5, "b": 0.0}) == "a"
    assert choice({"a": 0.7, "b": 0.0}) == "b"  # a's cache is full of others' histories
    assert choice({"a": 1.0, "b": 1.0}) == "a"  # every cache full: the prefix decides
    # The holder of a conversation's whole history keeps it, however full.
    holds["a"] = frozenset(keys)
    assert choice({"a": 1.0, "b": 0.1}) == "a"
