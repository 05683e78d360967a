"""Per-request block tables over a BlockPool."""

from __future__ import annotations

from engine.core.block_pool import BlockPool, KVCacheBlock
from engine.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps each request to the blocks that hold its KV.

    Capacity is a return value: `allocate_slots` returns None when the pool runs dry and
    leaves everything as it was. A broken invariant is an exception (`check_integrity`).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        # Plain int view of each table, kept in step with _blocks for the runner.
        self._block_ids: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones.

        Returns the ids of the blocks added (possibly none), or None if the pool has too few
        free blocks, in which case nothing changes.
        """
        rid = request.request_id
        held = len(self._block_ids.get(rid, ()))
        # cdiv inlined: this runs for every request on every step.
        need = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size) - held
        if need <= 0:
            return []
        new_blocks = self.pool.take(need)
        if new_blocks is None:
            return None
        new_ids = [b.block_id for b in new_blocks]
        self._blocks.setdefault(rid, []).extend(new_blocks)
        self._block_ids.setdefault(rid, []).extend(new_ids)
        return new_ids

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table. NOTE: a live list; read it before the next allocation."""
        return self._block_ids.get(request_id, [])

    def free(self, request_id: str) -> None:
        """Return every block of the request to the pool (no-op if it holds none)."""
        blocks = self._blocks.pop(request_id, None)
        self._block_ids.pop(request_id, None)
        if blocks:
            self.pool.release(blocks)

    def request_ids(self) -> set[str]:
        """Ids of the requests that hold blocks."""
        return set(self._blocks)

    def check_integrity(self) -> None:
        """free + used == total, and each block's ref count equals the tables holding it."""
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for req_id, table in self._blocks.items():
            assert [b.block_id for b in table] == self._block_ids[req_id], f"{req_id}: id view"
            for block in table:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                f"held by {refs.get(block.block_id, 0)} tables"
            )
        used = sum(1 for b in self.pool.blocks if b.ref_cnt > 0)
        assert used + self.pool.num_free_blocks == self.pool.num_blocks, "free + used != total"
