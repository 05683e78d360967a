"""A fixed pool of KV cache blocks with reference counts and an O(1) free queue."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class KVCacheBlock:
    """One block of `block_size` token slots in every layer's K and V tensors."""

    block_id: int
    ref_cnt: int = 0


class BlockPool:
    """Hands out blocks and takes them back.

    Free blocks wait in an insertion-ordered queue (least recently freed first), so taking
    and returning a block are O(1) and the order is deterministic.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def take(self, n: int) -> list[KVCacheBlock] | None:
        """Take `n` free blocks (ref count 1 each), or None, taking nothing, if too few are free."""
        if n > len(self._free):
            return None
        taken = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def release(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference to each block; a block whose count reaches 0 becomes free.

        Blocks are queued in reverse, so the tail of a sequence is reused before its head.
        """
        for block in reversed(blocks):
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} released with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def check_integrity(self) -> None:
        """Raise AssertionError if free-queue membership and ref counts disagree."""
        for block in self.blocks:
            in_free = block.block_id in self._free
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            assert in_free == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in_free={in_free}"
            )
        assert all(self._free[i] is self.blocks[i] for i in self._free), "foreign block in queue"
