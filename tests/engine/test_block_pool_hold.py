"""Held blocks (the simulator's decode cohort): counted as used at once, chosen later."""

from __future__ import annotations

from engine.core.block_pool import BlockPool


def test_held_blocks_count_as_used_until_taken_or_given_back():
    pool = BlockPool(10)
    assert pool.hold(4) and pool.num_free_blocks == 6 and pool.usage() == 0.4
    assert pool.take(7) is None and not pool.hold(7)  # nothing changed by either
    assert pool.num_free_blocks == 6
    taken = pool.take(3, held=True)
    assert taken is not None and len(taken) == 3 and pool.held == 1
    assert pool.num_free_blocks == 6  # held blocks were used already
    pool.unhold(1)
    assert pool.num_free_blocks == 7
    pool.release(taken)
    assert pool.num_free_blocks == 10 and pool.held == 0
    pool.check_integrity()
