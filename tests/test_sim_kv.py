"""The KV block allocator: prefix hashing, reference counts, LRU eviction of cached blocks."""

from __future__ import annotations

import pytest

from fuzzer.errors import ConfigError
from fuzzer.sim.kv import KVCache, block_hashes


def test_block_hashes_chain_full_blocks_only():
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2
    b = block_hashes(list(range(32)) + [99] * 8, 16)
    assert a == b  # the partial third block is not hashed
    c = block_hashes([7] + list(range(1, 40)), 16)
    assert c[0] != a[0] and c[1] != a[1]  # a different first block changes every later hash


def test_released_blocks_stay_cached_until_evicted_lru():
    kv = KVCache(4, 16)
    hashes = block_hashes(list(range(32)), 16)
    first = kv.allocate(2)
    for b, h in zip(first, hashes):
        kv.commit(b, h)
    kv.release(first)
    assert kv.num_free == 4 and kv.num_used == 0
    assert kv.lookup(hashes, 2) == first  # revivable
    kv.allocate(2)  # takes the two never-used blocks first
    assert kv.lookup(hashes, 2) == first
    kv.allocate(1)  # evicts the least recently freed: the tail block (released first)
    assert kv.lookup(hashes, 2) == [first[0]]
    kv.check_invariants()


def test_acquire_revives_a_cached_free_block():
    kv = KVCache(3, 4)
    (b,) = kv.allocate(1)
    kv.commit(b, 123)
    kv.release([b])
    assert kv.blocks_needed(0, 2, [b]) == 2  # one revived + one new
    kv.acquire([b])
    assert kv.num_used == 1 and kv.num_free == 2
    kv.acquire([b])  # a second request shares it
    kv.release([b])
    assert kv.num_used == 1
    kv.release([b])
    assert kv.num_used == 0
    kv.check_invariants()


def test_release_without_keeping_the_cache():
    kv = KVCache(2, 4)
    (b,) = kv.allocate(1)
    kv.commit(b, 5)
    kv.release([b], keep_cached=False)
    assert kv.lookup([5], 1) == [] and kv.num_cached == 0


def test_over_allocation_is_an_error_not_silent():
    kv = KVCache(2, 4)
    kv.allocate(2)
    with pytest.raises(ConfigError):
        kv.allocate(1)
    assert kv.usage == 1.0
