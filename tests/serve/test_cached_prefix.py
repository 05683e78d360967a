"""KV-aware routing's choice (cluster/prefix_routing.py): the replica holding the
longest prefix of the prompt, unless its load outweighs what it holds; a prefix many prompts
share (cluster/shared_prefixes.py) counts as held by all."""

from __future__ import annotations

from array import array

from cluster.prefix_routing import cached_prefix, kv_ranked
from cluster.shared_prefixes import SharedPrefixes
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


def test_the_token_after_a_block_tells_a_shared_prefix_from_one_conversations_history():
    shared = SharedPrefixes(horizon_s=60.0)
    system = list(range(2000, 2096))  # 6 blocks
    turn1 = [*system, *range(3000, 3064)]
    turn2 = [*turn1, *range(3100, 3228)]  # the same conversation, extended

    def observe(prompt: list[int], now: float) -> list[int]:
        keys = prompt_block_hashes(prompt, 16)
        shared.observe(prompt, keys, 16, now)
        return keys

    keys = observe(turn1, 0.0)
    assert shared.shared_blocks(keys, 1) == len(keys) and shared.shared_blocks(keys, 2) == 0
    # Its next turn follows every block with the same token as before: nothing branches.
    keys = observe(turn2, 1.0)
    assert shared.shared_blocks(keys, 2) == 0
    # Another conversation on the system prompt: the prompts branch after its 6 blocks.
    other = observe([*system, *range(4000, 4064)], 2.0)
    assert shared.shared_blocks(other, 2) == 6 and shared.shared_blocks(keys, 2) == 6
    assert shared.shared_blocks(other, 3) == 0  # worth a copy on two replicas, not three
    # A minute without it: forgotten.
    assert shared.shared_blocks(observe(list(range(9000, 9040)), 63.0), 1) == 2
    assert len(shared) == 2 and shared.shared_blocks(other, 2) == 0
    # However many prompts come within the minute, only the most recent blocks are kept.
    bounded = SharedPrefixes(max_blocks=8)
    for start in range(0, 800, 40):
        prompt = list(range(start, start + 40))
        bounded.observe(prompt, prompt_block_hashes(prompt, 16), 16, now=0.0)
    assert len(bounded) == 8


def test_conversations_on_a_shared_system_prompt_spread_however_far_apart_they_come():
    """Each prompt ends before the next comes (loads stay 0): the first replica to hold the
    system prompt used to take every conversation. Now it counts as held by both once two
    conversations have followed it, new ones go by cache fill, and every later turn goes
    where its conversation's history is."""
    system = list(range(2000, 2096))
    convs = [[*system, *range(10_000 * (c + 1), 10_000 * (c + 1) + 64)] for c in range(20)]
    held: dict[str, set[int]] = {"a": set(), "b": set()}
    capacity = 200  # blocks a replica's cache holds
    shared, where = SharedPrefixes(), {}
    for turn in range(3):
        for c, prompt in enumerate(convs):
            keys = prompt_block_hashes(prompt, 16)
            common = shared.observe(prompt, keys, 16, now=turn * 3.0 + c * 0.1, replicas=2)
            fill = {r: len(h) / capacity for r, h in held.items()}
            chosen = kv_ranked(
                ["a", "b"], keys, {"a": 0, "b": 0}.get, held.get, 8.0, fill.get, common
            )
            replica = chosen[0][0]
            assert where.setdefault(c, replica) == replica, (turn, c)  # the history's replica
            held[replica].update(keys)
            convs[c] = [*prompt, *range(prompt[-1] + 1, prompt[-1] + 129)]  # reply, next message
    assert sorted(list(where.values()).count(r) for r in "ab") == [10, 10]
