"""`BlockManager`: the paged KV cache's bookkeeping — free list, ref counts, prefix cache.

The pool is `num_blocks` blocks of `block_size` token slots (the tensors live in the model runner;
this module knows nothing about them, about models or about scheduling policy). A sequence owns
a `block_table`; token j of a sequence lives in slot `block_table[j // block_size] * block_size +
j % block_size`.

Prefix cache. A block is hashed once every one of its tokens has its K/V computed (prompt or
generated tokens alike), as a chain: `block_hash(parent_hash, token_ids)` = Python's `hash` of the
tuple `(parent_hash, token_ids)`. Ints hash deterministically (PYTHONHASHSEED only salts str and
bytes), so hashes are stable across processes. A hash is only a lookup key: a hit is served only
if the block's stored token ids equal the request's and its stored parent is the block we just
matched, so a collision costs a recompute, never wrong K/V. Blocks whose ref count drops to 0
stay in the cache ("cached-free") at the MRU end of the free list; allocation takes from the LRU
end and evicts whatever it takes. Only free blocks are ever evicted. The last prompt token is
never served from cache (its logits are needed), so matching stops at `num_tokens - 1`.
With multi-LoRA serving the chain starts from the sequence's adapter (`root_hash`), and a block
remembers its adapter, so two adapters never share the K/V of the same tokens.
"""

from __future__ import annotations

from collections import OrderedDict

from .sequence import Sequence


def block_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


def root_hash(lora_int_id: int = 0) -> int:
    """The parent hash of a sequence's first block: -1 for the base model, else one per adapter id."""
    return -1 if not lora_int_id else hash((-1, lora_int_id))


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "parent_id", "lora_int_id")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.reset()

    def reset(self) -> None:
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.parent_id = -1
        self.lora_int_id = 0  # the adapter whose K/V it holds (0: the base model)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 contiguous_runs: bool = False):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.contiguous_runs = contiguous_runs  # allocate so a sequence's blocks stay one run (see _next_block)
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.hash_to_block: dict[int, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up, like vLLM's counters
        self.prefix_cache_hits = 0  # tokens served from cache

    def forget_cached(self) -> None:
        """Drop every cached block (every block must be free: their K/V came from old weights), and hand
        them out in a fresh pool's order: which blocks a sequence gets decides whether the attention reads
        them in place or gathers them (another summation order), so the next outputs are bit-for-bit those
        of an engine started on these weights, whatever ran before."""
        self.hash_to_block.clear()
        for block in self.blocks:
            block.reset()
        self.free = OrderedDict.fromkeys(range(self.num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)  # includes cached-free blocks: they can be evicted on demand

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    # ---- admission: prefix-cache lookup -----------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """Block ids and hashes of the longest cached, verified prefix of full blocks (not taken yet)."""
        if not self.enable_prefix_caching:
            return [], []
        bs, ids, hashes, parent_hash, parent_id = self.block_size, [], [], root_hash(seq.lora_int_id), -1
        for i in range((seq.num_tokens - 1) // bs):  # never the block holding the last token
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = block_hash(parent_hash, tokens)
            block = self.blocks[self.hash_to_block[h]] if h in self.hash_to_block else None
            if (block is None or block.token_ids != tokens or block.parent_id != parent_id
                    or block.lora_int_id != seq.lora_int_id):
                break
            ids.append(block.block_id)
            hashes.append(h)
            parent_hash, parent_id = h, block.block_id
        return ids, hashes

    def can_admit(self, seq: Sequence, hit_ids: list[int], num_new_tokens: int) -> bool:
        """Enough free blocks for the tokens past the hits, not counting hits that are free now."""
        needed = -(-(len(hit_ids) * self.block_size + num_new_tokens) // self.block_size) - len(hit_ids)
        return needed <= len(self.free) - sum(1 for b in hit_ids if b in self.free)

    def admit(self, seq: Sequence, hit_ids: list[int], hashes: list[int]) -> None:
        for block_id in hit_ids:
            self._take(block_id)
        seq.block_table, seq.block_hashes = list(hit_ids), list(hashes)
        seq.num_computed_tokens = len(hit_ids) * self.block_size
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += seq.num_computed_tokens

    # ---- growth, caching, release -----------------------------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give `seq` the blocks its next `num_new_tokens` tokens need (caller checked they exist)."""
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            block_id = self._next_block(seq.block_table)
            del self.free[block_id]
            self._evict(block_id)
            self.blocks[block_id].ref_count = 1
            seq.block_table.append(block_id)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks of `seq` that became full of computed tokens since the last call."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = block_hash(seq.block_hashes[-1] if i else root_hash(seq.lora_int_id), tokens)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:  # a hit block is already cached under this very key
                block.hash, block.token_ids, block.lora_int_id = h, tokens, seq.lora_int_id
                block.parent_id = seq.block_table[i - 1] if i else -1
                self.hash_to_block.setdefault(h, block.block_id)  # keep an existing twin
            seq.block_hashes.append(h)

    def free_seq(self, seq: Sequence) -> None:
        """Drop `seq`'s references. Reversed, so a sequence's tail is evicted before its head."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None  # MRU end
                if block.hash is None:  # nothing worth keeping: reuse it first
                    self.free.move_to_end(block_id, last=False)
        seq.block_table, seq.block_hashes = [], []

    def _next_block(self, table: list[int]) -> int:
        """Keep a sequence's blocks one run where it can (attention then reads them in place, no gather):
        the block after its last one when that is free and holds nothing cached; a new run starts in the
        middle of the longest stretch of such blocks, leaving room to grow on both sides (an O(num_blocks)
        scan per new sequence). Else, or without `contiguous_runs`, the LRU end."""
        if not self.contiguous_runs:
            return next(iter(self.free))  # LRU end: evict what has waited longest
        if table:
            nxt = table[-1] + 1
            if nxt in self.free and self.blocks[nxt].hash is None:
                return nxt
            return next(iter(self.free))
        best_start, best_len, start = 0, 0, -1
        for b in range(self.num_blocks + 1):
            empty = b < self.num_blocks and b in self.free and self.blocks[b].hash is None
            if empty and start < 0:
                start = b
            elif not empty and start >= 0:
                if b - start > best_len:
                    best_start, best_len = start, b - start
                start = -1
        if best_len == 0:
            return next(iter(self.free))  # LRU end: evict what has waited longest
        return best_start + best_len // 2 if best_start > 0 else best_start

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.reset()
