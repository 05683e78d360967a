"""A moved sequence's KV sent over the replicas' direct link (engine/runner/kv_link.py), both
ways (its bytes on the connection; a p2p group, gloo here as NCCL between GPUs), goes on at
the target exactly as an undisturbed run without computing its context; an offer is held until
withdrawn and can be taken again meanwhile; a withdrawn offer, a source gone and a source dying
mid-transfer fail the fetch (the target then computes the context: tests/serve)."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time

import pytest
import torch

from engine.core.request import Resume
from engine.runner.kv_link import KVLink, KVOffer
from tests.engine.test_sequence_kv import (
    GREEDY,
    SEEDED,
    assert_no_block_held,
    counting_tokens,
    engine,
    run,
    text,
    tokens,
)

CPU = torch.device("cpu")


@pytest.fixture
def links():
    source, target = KVLink("127.0.0.1", "source", 10.0), KVLink("127.0.0.1", "target", 10.0)
    yield source, target
    source.close()
    target.close()


def moved(tiny_model, params, steps=3, **knobs):
    """An undisturbed run's deltas, and a run moved out after `steps` steps: (its deltas,
    its KV)."""
    source = engine(tiny_model, **knobs)
    whole = run(source, "whole", params)
    before = run(source, "r", params, steps=steps) + source.settle()
    kv = source.move_out(["r"])["r"]
    assert_no_block_held(source)
    return whole, before, kv


def go_on(tiny_model, before, kv, params, **knobs):
    """The moved run finished at a new engine from `kv`: (its deltas, the tokens its steps
    computed)."""
    target = engine(tiny_model, **knobs)
    computed = counting_tokens(target)
    after = run(target, "r", params, resume=Resume(tokens(before), len(text(before)), kv))
    assert_no_block_held(target)
    assert target.num_kv_refused == 0
    return after, computed


def sent(source: KVLink, way: str, n: int) -> int:
    """Transfers the source counts as sent, once it counts `n` or 5 s have passed (its side
    ends just after the target's)."""
    deadline = time.monotonic() + 5
    while source.num_sent[way] < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return source.num_sent[way]


@pytest.mark.parametrize("way", ["host", "p2p"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_sequence_moved_over_the_link_goes_on_exactly(tiny_model, links, way, params):
    source, target = links
    whole, before, kv = moved(tiny_model, params)
    offer = source.offer(kv)
    assert offer.kv.data is None and offer.nbytes == kv.nbytes > 0
    taken = target.fetch(offer, CPU, p2p=way == "p2p")
    assert torch.equal(torch.as_tensor(taken.data), kv.data)
    assert taken.token_ids == kv.token_ids and taken.scales == kv.scales
    after, computed = go_on(tiny_model, before, taken, params)
    assert tokens(before) + tokens(after) == tokens(whole)
    assert text(before) + text(after) == text(whole)
    assert computed == [1] * len(tokens(after))
    # Held until withdrawn: a second target (one that died before importing it) may take it
    # again, on the pair's group where p2p.
    again = target.fetch(offer, CPU, p2p=way == "p2p")
    assert torch.equal(torch.as_tensor(again.data), kv.data)
    assert target.num_taken[way] == 2
    assert sent(source, way, 2) == 2
    assert target.num_p2p_failures == 0
    source.withdraw(offer)
    assert source.num_offers == 0
    with pytest.raises(LookupError, match="withdrawn"):
        target.fetch(offer, CPU, p2p=way == "p2p")
    assert target.num_p2p_failures == 0  # not a failure of the way: nothing to take


def test_fp8_kv_moves_over_the_link_with_its_scales(tiny_model, links):
    source, target = links
    fp8 = {"kv_cache_dtype": "fp8_e4m3", "calculate_kv_scales": True}
    whole, before, kv = moved(tiny_model, GREEDY, **fp8)
    taken = target.fetch(source.offer(kv), CPU)
    assert taken.cache_dtype == "float8_e4m3fn" and taken.scales == kv.scales
    after, computed = go_on(tiny_model, before, taken, GREEDY, **fp8)
    assert tokens(before) + tokens(after) == tokens(whole)
    assert computed == [1] * len(tokens(after))


def test_transfers_between_pairs_go_on_at_once(tiny_model):
    """Two targets take from one source at the same time, each on its own p2p group."""
    _, _, kv = moved(tiny_model, GREEDY)
    source = KVLink("127.0.0.1", "source", 10.0)
    targets = [KVLink("127.0.0.1", f"target{i}", 10.0) for i in range(2)]
    offers = [source.offer(kv) for _ in targets]
    taken: list = [None, None]

    def take(i: int) -> None:
        taken[i] = targets[i].fetch(offers[i], CPU, p2p=True)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(t is not None and torch.equal(torch.as_tensor(t.data), kv.data) for t in taken)
    assert sent(source, "p2p", 2) == 2
    for link in (source, *targets):
        link.close()


def test_a_fetch_fails_where_the_source_is_gone_or_dies_mid_transfer(tiny_model, links):
    source, target = links
    _, _, kv = moved(tiny_model, GREEDY)
    offer = source.offer(kv)
    source.close()  # its replica ended
    for p2p in (False, True):
        with pytest.raises(OSError):
            target.fetch(offer, CPU, p2p=p2p)
    # A source that answers, sends half the bytes and dies.
    server = socket.create_server(("127.0.0.1", 0))

    def die_halfway() -> None:
        conn, _ = server.accept()
        conn.makefile("rb").readline()
        answer = {"nbytes": offer.nbytes}
        conn.sendall(json.dumps(answer).encode() + b"\n" + bytes(offer.nbytes // 2))
        conn.close()

    threading.Thread(target=die_halfway, daemon=True).start()
    dying = dataclasses.replace(offer, port=server.getsockname()[1])
    with pytest.raises(ConnectionError, match="mid-transfer"):
        target.fetch(dying, CPU, p2p=False)
    server.close()


def test_an_offer_carries_what_the_bytes_are_and_not_the_bytes(tiny_model, links):
    source, _ = links
    _, _, kv = moved(tiny_model, GREEDY)
    offer = source.offer(kv)
    assert isinstance(offer, KVOffer) and offer.device == "cpu"
    assert offer.shape == tuple(kv.data.shape) and offer.kv.num_tokens == kv.num_tokens
    assert len(json.dumps(dataclasses.asdict(offer.kv))) < 4096  # plain and small
