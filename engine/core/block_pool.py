"""A fixed pool of KV cache blocks with reference counts, an O(1) LRU free queue, and the
prefix cache: full blocks keyed by a chained hash, kept (and revivable) after they are freed
until the queue hands them out again."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import islice


@dataclass
class KVCacheBlock:
    """One block of `block_size` token slots in every layer's K and V tensors."""

    block_id: int
    ref_cnt: int = 0
    # Set once the block is full and computed (prefix caching): the chained hash of
    # (parent's hash, these tokens), the parent's hash (the first block's: its request's
    # cache_salt), and the tokens, compared on every hit.
    block_hash: int | None = None
    parent_hash: object = None
    token_ids: tuple[int, ...] | None = None


class BlockPool:
    """Hands out blocks and takes them back.

    Free blocks wait in an insertion-ordered queue (least recently freed first), so taking
    and returning a block are O(1) and the order is deterministic. A freed block keeps its
    content and hash: `touch` revives it on a prefix-cache hit; `take` evicts the least
    recently freed one.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached: dict[int, KVCacheBlock] = {}  # block hash -> the block holding it
        # Free blocks promised to no block in particular (`hold`): in use by every count.
        self.held = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) - self.held

    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - (len(self._free) - self.held) / self.num_blocks

    def cache_fill(self) -> float:
        """Fraction of blocks holding a cached prompt block (in use or not), in [0, 1]."""
        return len(self.cached) / self.num_blocks

    def hold(self, n: int) -> bool:
        """Count `n` free blocks as used without choosing them (the simulator's decode
        cohort: blocks whose ids nothing reads yet); False, holding none, if too few are
        free. `take(n, held=True)` turns held blocks into blocks, `unhold` gives them back."""
        if n > len(self._free) - self.held:
            return False
        self.held += n
        return True

    def unhold(self, n: int) -> None:
        assert 0 <= n <= self.held, (n, self.held)
        self.held -= n

    def take(self, n: int, held: bool = False) -> list[KVCacheBlock] | None:
        """Take `n` free blocks (ref count 1 each), or None, taking nothing, if too few are
        free; `held`: blocks held before."""
        if held:
            self.unhold(n)
        elif n > len(self._free) - self.held:
            return None
        taken = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:  # evict its cached content
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = block.parent_hash = block.token_ids = None
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """One more reference to each (prefix-cache hits); free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def register(
        self, block: KVCacheBlock, block_hash: int, parent_hash: object, tokens: tuple
    ) -> None:
        """Record a full, computed block under its hash (first holder of a hash wins)."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, tokens
            self.cached[block_hash] = block

    def recent_hashes(self, limit: int) -> list[int]:
        """The keys of the blocks the prefix cache holds, the most recently registered first,
        at most `limit`."""
        return list(islice(reversed(self.cached), limit))

    def lookup(self, block_hash: int, parent_hash: object, tokens: tuple) -> KVCacheBlock | None:
        """The cached block with this content, verified by its tokens and parent, or None."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tokens or block.parent_hash != parent_hash:
            return None
        return block

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
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"block {block.block_id}: stale cache entry"
