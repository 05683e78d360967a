"""Per-request block tables over a BlockPool, with prefix caching.

Prefix caching: once a block is full and its KV computed, it is registered under the chained
hash of (its parent block's hash, its token ids). A request that starts (or restarts after
preemption) with nothing computed reuses the longest chain of cached blocks that match its
tokens (compared, not only hashed) and computes only the rest, at least its last token, whose
logits it needs. Shared blocks are only read: a request writes only into blocks past its hit.
"""

from __future__ import annotations

from engine.core.block_hashes import block_hash
from engine.core.block_pool import BlockPool, KVCacheBlock
from engine.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps each request to the blocks that hold its KV.

    Capacity is a return value: `allocate_slots` returns None when the pool runs dry and
    leaves everything as it was. A broken invariant is an exception (`check_integrity`).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        # Swap preemption: a second pool whose blocks live in host memory.
        self.host_pool = BlockPool(num_host_blocks) if num_host_blocks > 0 else None
        self._host: dict[str, list[KVCacheBlock]] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        # Plain int view of each table, kept in step with _blocks for the runner.
        self._block_ids: dict[str, list[int]] = {}
        # Chained hashes of each request's registered (full, computed) blocks, in order.
        self._hashes: dict[str, list[int]] = {}
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the cache

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
        if rid not in self._blocks:
            self._blocks[rid], self._block_ids[rid] = [], []
            if self.enable_prefix_caching:
                self._hashes[rid] = []
        self._blocks[rid].extend(new_blocks)
        self._block_ids[rid].extend(new_ids)
        return new_ids

    def append_held(self, request: Request, n: int) -> None:
        """`n` blocks held in the pool (BlockPool.hold) appended to the request's table."""
        new_blocks = self.pool.take(n, held=True)
        assert new_blocks is not None
        self._blocks[request.request_id].extend(new_blocks)
        self._block_ids[request.request_id].extend(b.block_id for b in new_blocks)

    def trim(self, request: Request) -> None:
        """Give back the blocks past those the request's tokens need (the lookahead slots
        of drafts that were rejected; none of them is full of computed tokens, so none is
        in the prefix cache)."""
        rid = request.request_id
        keep = cdiv(request.num_tokens, self.block_size)
        table = self._blocks.get(rid)
        if table is None or len(table) <= keep:
            return
        extra = table[keep:]
        del table[keep:]
        del self._block_ids[rid][keep:]
        self.pool.release(extra)

    # ------------------------------------------------------------------ prefix caching
    def match_prefix(self, request: Request) -> list[KVCacheBlock]:
        """The cached blocks that hold the request's leading tokens (not yet referenced); none
        for a request that reads every prompt position (prompt logprobs, mean pooling)."""
        if not self.enable_prefix_caching or request.sampling_params.computes_whole_prompt:
            return []
        bs, tokens = self.block_size, request.all_token_ids
        hit: list[KVCacheBlock] = []
        parent: object = request.cache_salt
        for i in range((request.num_tokens - 1) // bs):  # leave the last token to compute
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            key = block_hash(parent, chunk)
            block = self.pool.lookup(key, parent, chunk)
            if block is None:
                break
            hit.append(block)
            parent = key
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hit) * bs
        return hit

    def admit(self, request: Request, hit: list[KVCacheBlock], num_new_tokens: int) -> bool:
        """Start a request's table with its cached blocks plus room for `num_new_tokens` after
        them. False (and nothing changed) if the pool cannot hold them."""
        rid = request.request_id
        assert rid not in self._blocks, f"{rid} already holds blocks"
        self.pool.touch(hit)
        need = cdiv(len(hit) * self.block_size + num_new_tokens, self.block_size) - len(hit)
        new_blocks = self.pool.take(need) if need > 0 else []
        if new_blocks is None:
            self.pool.release(hit)
            return False
        table = hit + new_blocks
        self._blocks[rid] = table
        self._block_ids[rid] = [b.block_id for b in table]
        if self.enable_prefix_caching:
            self._hashes[rid] = [b.block_hash for b in hit]  # type: ignore[misc]
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that became full and computed since the last call."""
        hashes = self._hashes.get(request.request_id)
        if hashes is None:
            return
        n_full = request.num_computed_tokens // self.block_size
        if n_full <= len(hashes):
            return
        bs, tokens = self.block_size, request.all_token_ids
        table = self._blocks[request.request_id]
        parent = hashes[-1] if hashes else request.cache_salt
        for i in range(len(hashes), n_full):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            key = block_hash(parent, chunk)
            self.pool.register(table[i], key, parent, chunk)
            hashes.append(key)
            parent = key

    # ------------------------------------------------------------------ swap preemption
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Give the request's device blocks back, its KV going to host blocks. Returns the
        (device, host) copies to make, or None (nothing changed) if the host pool is full."""
        rid = request.request_id
        table = self._blocks.get(rid, [])
        if self.host_pool is None or not table:
            return None
        host = self.host_pool.take(len(table))
        if host is None:
            return None
        copies = [(d.block_id, h.block_id) for d, h in zip(table, host, strict=True)]
        self.free(rid)  # the device blocks keep their prefix-cache content until reused
        self._host[rid] = host
        return copies

    def admit_waiting(
        self, request: Request, budget: int, swapped: bool
    ) -> tuple[int, list[tuple[int, int]]] | None:
        """Blocks for a waiting request's next chunk of at most `budget` tokens: its swapped
        KV back from the host (with the (host, device) copies to make), blocks for the KV it
        carries from another replica plus the chunk, or its cached prefix plus new blocks
        (`num_computed_tokens` set to the KV's length). Returns the chunk's token count and
        the copies, or None (nothing changed) if the pool is too full."""
        if swapped:
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            copies = self.swap_in(request, n)
            return None if copies is None else (n, copies)
        # Nothing computed here: new, preempted and reset, or carrying KV computed at another
        # replica (blocks to write it into, in place of a prefix-cache hit).
        carried = request.carried_kv
        hit = [] if carried is not None else self.match_prefix(request)
        num_cached = carried.num_tokens if carried is not None else len(hit) * self.block_size
        n = min(request.num_tokens - num_cached, budget)
        if not self.admit(request, hit, num_cached - len(hit) * self.block_size + n):
            return None
        request.num_computed_tokens = num_cached
        if request.num_cached_prompt_tokens is None:  # (a preempted request's own blocks later)
            from_cache = 0 if carried is not None else num_cached
            request.num_cached_prompt_tokens = min(from_cache, request.num_prompt_tokens)
        return n, []

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Device blocks for a swapped request's KV plus `num_new_tokens`; returns the
        (host, device) copies to make, or None (nothing changed) if the pool is too full."""
        rid = request.request_id
        host = self._host[rid]
        need = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        device = self.pool.take(max(need, len(host)))
        if device is None:
            return None
        copies = [(h.block_id, d.block_id) for h, d in zip(host, device[: len(host)], strict=True)]
        del self._host[rid]
        assert self.host_pool is not None
        self.host_pool.release(host)
        self._blocks[rid] = device
        self._block_ids[rid] = [b.block_id for b in device]
        if self.enable_prefix_caching:
            self._hashes[rid] = []  # re-registered from the start by cache_full_blocks
        return copies

    def swapped_ids(self) -> set[str]:
        return set(self._host)

    @property
    def num_free_host_blocks(self) -> int:
        return self.host_pool.num_free_blocks if self.host_pool else 0

    @property
    def block_tables(self) -> dict[str, list[int]]:
        """Every request's block table by id. NOTE: live objects; read, never modify."""
        return self._block_ids

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table. NOTE: a live list; read it before the next allocation."""
        return self._block_ids.get(request_id, [])

    def host_block_ids(self, request_id: str) -> list[int]:
        """A swapped request's host blocks, which hold its KV."""
        return [b.block_id for b in self._host.get(request_id, [])]

    def free(self, request_id: str) -> None:
        """Return every block of the request to the pool (no-op if it holds none)."""
        blocks = self._blocks.pop(request_id, None)
        self._block_ids.pop(request_id, None)
        self._hashes.pop(request_id, None)
        if blocks:
            self.pool.release(blocks)
        host = self._host.pop(request_id, None)
        if host:
            assert self.host_pool is not None
            self.host_pool.release(host)

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
        if self.host_pool is not None:
            self.host_pool.check_integrity()
            held = [b.block_id for table in self._host.values() for b in table]
            assert len(held) == len(set(held)), "a host block is in two tables"
            assert all(b.ref_cnt == 1 for t in self._host.values() for b in t), "host ref count"
            assert len(held) + self.host_pool.num_free_blocks == self.host_pool.num_blocks
        else:
            assert not self._host, "swapped tables without a host pool"
