"""Random add/step/abort sequences keep the cache sound and give every block back."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.config import SchedulerLimits
from tests.engine.helpers import make_request, make_scheduler, step

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 20)),
        st.tuples(st.just("step"), st.integers(0, 3)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("limits"), st.integers(1, 6), st.integers(1, 48)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=ops,
    num_blocks=st.integers(15, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    batching=st.sampled_from(["continuous", "static"]),
)
def test_random_traffic_keeps_integrity_and_frees_every_block(
    ops, num_blocks, block_size, batching
):
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=4,
        max_num_batched_tokens=24,
        max_model_len=num_blocks * block_size,
        batching=batching,
    )
    added: list[str] = []
    produced: dict[str, int] = {}
    for op in ops:
        if op[0] == "add":
            rid = f"r{len(added)}"
            try:
                sched.add_request(make_request(rid, op[1], max_tokens=op[2], ignore_eos=False))
            except ValueError:
                continue  # too long for this cache: refused, nothing held
            added.append(rid)
        elif op[0] == "step":
            _, results = step(sched, token=op[1])  # token 2 is EOS: some stop early
            for r in results:
                produced[r.request_id] = produced.get(r.request_id, 0) + len(r.new_token_ids)
        elif op[0] == "abort" and added:
            sched.abort_requests([added[op[1] % len(added)]])
        elif op[0] == "limits":
            sched.set_limits(SchedulerLimits(op[1], op[2]))
        sched.check_integrity()
    sched.set_limits(SchedulerLimits(4, 24))
    for _ in range(5000):
        if not sched.has_unfinished_requests():
            break
        _, results = step(sched)
        for r in results:
            produced[r.request_id] = produced.get(r.request_id, 0) + len(r.new_token_ids)
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks
    sched.check_integrity()
