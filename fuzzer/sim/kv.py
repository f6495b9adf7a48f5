"""The KV cache: fixed-size blocks, prefix caching by block hash, LRU eviction.

As in vLLM v1 (docs/design/prefix_caching.md): only full blocks are cached; a
block's hash covers its parent's hash and its own token ids, so equal hashes
mean equal prefixes. A block whose last user released it stays in the cache
(revivable by a later prefix hit) until the allocator needs it: free blocks form
an LRU queue and the least recently freed one is evicted first. A request's
blocks are released tail first, so the tail of a prompt is evicted before its
head (the head is the part other requests are most likely to share).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from fuzzer.errors import ConfigError


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hash of every full block of a token sequence."""
    out: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        out.append(parent)
    return out


class KVCache:
    """Block allocator with a prefix cache. Block ids are 0..num_blocks-1."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ConfigError(f"KV cache needs >= 1 block of >= 1 token, got {num_blocks} x {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}
        #: Blocks nobody references, least recently freed first (the eviction order).
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    # --- queries --------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free, cached or not)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests (cached-but-free blocks count as free, as in vLLM)."""
        return self.num_used / self.num_blocks

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Ids of the longest run of cached blocks matching ``hashes`` from the start."""
        hit: list[int] = []
        for h in hashes[:max_blocks]:
            block = self._cached.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def blocks_needed(self, held: int, required: int, hits: Sequence[int] = ()) -> int:
        """New blocks an allocation must take, counting cached hits that are currently free."""
        revived = sum(1 for b in hits if self._ref[b] == 0)
        return max(0, required - held - len(hits)) + revived

    # --- changes ----------------------------------------------------------------------

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for b in blocks:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` free blocks, evicting the least recently freed cached ones."""
        if count > len(self._free):
            raise ConfigError(f"KV cache: asked for {count} blocks with {len(self._free)} free")  # engine bug
        out = []
        for _ in range(count):
            b, _none = self._free.popitem(last=False)
            h = self._hash[b]
            if h is not None:
                if self._cached.get(h) == b:
                    del self._cached[h]
                self._hash[b] = None
            self._ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int], *, keep_cached: bool = True) -> None:
        """Drop a reference on each block, tail first; unreferenced blocks become free."""
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if not keep_cached:
                    h = self._hash[b]
                    if h is not None and self._cached.get(h) == b:
                        del self._cached[h]
                    self._hash[b] = None
                self._free[b] = None

    def commit(self, block: int, block_hash: int) -> None:
        """Mark a fully computed block as holding the prefix ``block_hash``."""
        if self._hash[block] is not None or block_hash in self._cached:
            return
        self._hash[block] = block_hash
        self._cached[block_hash] = block

    def check_invariants(self) -> None:
        """For tests: reference counts, the free queue and the cache map agree."""
        assert all(r >= 0 for r in self._ref)
        assert set(self._free) == {b for b, r in enumerate(self._ref) if r == 0}
        for h, b in self._cached.items():
            assert self._hash[b] == h
