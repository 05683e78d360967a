"""Multi-turn conversations as simulated requests, and the token ids that stand for a
simulated prompt's content where a prefix cache or a prefix router needs some.

A conversation's turns arrive a user's think time apart (open loop: the think time stands for
reading the reply too); turn k's prompt is the system prompt, the earlier turns' user messages
and replies, and its own message, so it extends turn k - 1's prompt token for token. The
replies in the history are the lengths generated, as a replayed trace holds them; the engine
caches prompt blocks, so what a later turn finds cached is the earlier turns' prompts.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import replace

from cluster.workload import LengthDist, SimRequest

# A token id is (its stream << 20) | its position; streams of requests of their own are
# marked apart from conversations' (bit 60).
_POSITION_BITS, _OWN = 20, 1 << 60
# A chat turn's user message and reply (tokens), and a user's pause before the next turn.
USER_TURN = LengthDist("lognormal", 120, 0.8, lo=8, hi=1024)
REPLY = LengthDist("lognormal", 250, 0.8, lo=8, hi=1024)
THINK_S = LengthDist("uniform", 10, 40)


def prompt_tokens(req: SimRequest) -> list[int]:
    """Token ids for `req`'s prompt: its first `shared_len` the same in every conversation,
    the rest its conversation's (equal across its turns, position by position), or its own
    where it has no conversation."""
    if req.conversation is None:
        own = _OWN | zlib.crc32(req.request_id.encode()) << _POSITION_BITS
        return [own | i for i in range(req.prompt_len)]
    stream = (req.conversation + 1) << _POSITION_BITS
    return [i if i < req.shared_len else stream | i for i in range(req.prompt_len)]


def make_conversations(
    num_conversations: int,
    rate: float,
    turns: int = 4,
    system_len: int = 512,
    user: LengthDist = USER_TURN,
    reply: LengthDist = REPLY,
    think_s: LengthDist = THINK_S,
    max_prompt_len: int = 4096,
    seed: int = 0,
) -> list[SimRequest]:
    """`num_conversations` starting as a Poisson process of `rate` per second, each of up to
    `turns` turns (fewer where the history would pass `max_prompt_len`), in arrival order."""
    if num_conversations < 0 or rate <= 0 or turns < 1:
        raise ValueError("need num_conversations >= 0, rate > 0 and turns >= 1")
    rng = random.Random(seed)
    start, out = 0.0, []
    for c in range(num_conversations):
        start += rng.expovariate(rate)
        arrival, history = start, system_len
        for turn in range(turns):
            if turn:
                arrival += think_s.sample(rng)
            prompt_len = history + user.sample(rng)
            output_len = reply.sample(rng)
            if prompt_len + output_len > max_prompt_len:
                break
            request_id = f"c{c}t{turn}"
            turn_of_c = SimRequest(request_id, arrival, prompt_len, output_len)
            out.append(replace(turn_of_c, conversation=c, shared_len=system_len))
            history = prompt_len + output_len
    return sorted(out, key=lambda r: r.arrival_s)
