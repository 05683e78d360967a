"""SharedPrefixes: where the prompts a router sends branch, so KV-aware routing
(cluster/prefix_routing.py's `kv_ranked`) can tell a prefix many prompts share (a system
prompt, a document asked about again and again) from one conversation's own history.

Routing by the blocks each replica holds follows a conversation to its history, which only
one replica has. For a shared prefix the first replica to hold it would win every new prompt
on it the same way, while its load stayed under what the prefix is worth: where nothing else
moved them (each prompt ended before the next came, no later turns between), never. Every
new conversation went to one replica until its cache was the fuller by the prefix's share of
the prompt, and then the later turns it could not hold went elsewhere without their history.
A prefix that at least as many distinct continuations have followed as there are replicas is
worth a copy on each (its prefill once per replica, repaid by the uses already seen), so the
router takes it as held everywhere: where the prompts after it go is for load, cache fill and
their own history to decide.

A continuation is told by the token after a block, not by the next block's key: each turn of
a conversation extends the last, so its blocks are followed by the same token every time
(one continuation), while the conversations after a system prompt each begin differently.
"""

from __future__ import annotations

from collections import OrderedDict

# Over how long continuations are counted: much longer than a user's pause between turns, as
# a shared prefix stays in the caches long after any one conversation on it has ended.
HORIZON_S = 60.0
# Continuations kept per block: enough to compare with any replica count in use.
MAX_CONTINUATIONS = 64
# Blocks kept, the least recently seen dropped first: a bound on the router's memory at any
# request rate (a shared prefix is seen with every prompt on it, so it stays).
MAX_BLOCKS = 16_384


class SharedPrefixes:
    """For each block key of the prompts seen in the last `horizon_s` (at most `max_blocks`
    of them, the most recently seen), the distinct tokens that followed it. Time is the
    caller's (`now`): the wall clock in the router, the simulated clock in the simulator."""

    def __init__(self, horizon_s: float = HORIZON_S, max_blocks: int = MAX_BLOCKS) -> None:
        self.horizon_s, self.max_blocks = horizon_s, max_blocks
        self._after: OrderedDict[int, tuple[float, set[int]]] = OrderedDict()

    def observe(
        self, prompt: list[int], keys: list[int], block_size: int, now: float, replicas: int = 1
    ) -> int:
        """Count the token after each full block of `prompt` (whose keys are `keys`,
        engine/core/block_hashes.py's: there is always a token after the last); return its
        `shared_blocks` for `replicas`, found on the way."""
        after, shared = self._after, 0
        for i, key in enumerate(keys):
            entry = after.pop(key, None)
            followers = entry[1] if entry is not None else set()
            if len(followers) < MAX_CONTINUATIONS:
                followers.add(prompt[(i + 1) * block_size])
            after[key] = (now, followers)
            if len(followers) >= replicas:
                shared = i + 1
        oldest = now - self.horizon_s
        while after and (len(after) > self.max_blocks or next(iter(after.values()))[0] < oldest):
            after.popitem(last=False)
        return shared

    def shared_blocks(self, keys: list[int], replicas: int) -> int:
        """How many of a prompt's leading blocks (`keys`) end at a branch that `replicas` or
        more continuations have followed: the length of its prefix worth a copy on each."""
        shared = 0
        for i, key in enumerate(keys):
            entry = self._after.get(key)
            if entry is None:
                break
            if len(entry[1]) >= replicas:
                shared = i + 1
        return shared

    def __len__(self) -> int:
        return len(self._after)
