"""The block pool and KV cache manager alone, with no model: sharing, eviction, invariants."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore import hashing
from kvstore.block_pool import BlockPool, NoFreeBlocksError
from kvstore.hashing import hash_full_blocks, make_salt
from kvstore.kv_cache_manager import KVAllocation, KVCacheManager

BLOCK = 4
SALT = make_salt("test-model", BLOCK, "float32")


def make_manager(num_blocks: int = 16) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks), BLOCK, enable_prefix_caching=True)


def run_prefill(
    manager: KVCacheManager, tokens: list[int], salt: bytes = SALT
) -> tuple[KVAllocation, int]:
    """Admit a sequence as the scheduler does: hit the cache, allocate, 'compute', commit."""
    alloc = KVAllocation(salt=salt)
    manager.update_hashes(alloc, tokens)
    cached = manager.match_prefix(alloc, tokens, 0)
    assert manager.allocate(alloc, len(tokens))
    manager.commit(alloc, tokens, len(tokens))
    return alloc, cached


def test_high_water_marks_the_blocks_ever_handed_out() -> None:
    pool = BlockPool(8)
    assert pool.high_water == 0
    first = pool.allocate(3)
    assert first == [0, 1, 2] and pool.high_water == 3  # a fresh pool hands blocks out in order
    pool.release(reversed(first))  # as a sequence is freed: its tail first
    # The blocks just freed first (on the CPU their pages are mapped), head first.
    assert pool.allocate(2) == [0, 1] and pool.high_water == 3
    assert pool.allocate(3) == [2, 3, 4] and pool.high_water == 5  # then never-used ones


def test_cached_blocks_are_evicted_only_when_no_empty_block_is_left() -> None:
    """A free block holding nothing is taken before a cached block is evicted, so cached KV
    lives as long as the pool has room that holds nothing."""
    pool = BlockPool(4)
    manager = KVCacheManager(pool, BLOCK, True)
    tokens = list(range(2 * BLOCK))
    alloc = KVAllocation(salt=SALT)
    manager.update_hashes(alloc, tokens)
    assert manager.allocate(alloc, len(tokens))
    manager.commit(alloc, tokens, len(tokens))
    manager.free(alloc)
    assert pool.num_cached == 2 and pool.num_free == 4
    taken = pool.allocate(2)
    assert set(taken) == {2, 3} and pool.num_cached == 2 and pool.num_evictions == 0
    # Then the least recently used cached block: the chain's tail, released first.
    assert pool.allocate(1) == [1] and pool.num_cached == 1 and pool.num_evictions == 1
    pool.check_invariants([taken, [1]])


def test_chain_hash_depends_on_prefix_salt_and_tokens() -> None:
    a = hash_full_blocks(SALT, [1, 2, 3, 4, 5, 6, 7, 8], BLOCK)
    b = hash_full_blocks(SALT, [9, 2, 3, 4, 5, 6, 7, 8], BLOCK)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second block, other prefix
    other_tenant = make_salt("test-model", BLOCK, "float32", namespace="tenant-b")
    assert hash_full_blocks(other_tenant, [1, 2, 3, 4], BLOCK)[0] != a[0]
    assert hash_full_blocks(SALT, [1, 2, 3, 4, 5, 6, 7], BLOCK) == a[:1]  # partial block unhashed
    resumed = hash_full_blocks(SALT, [1, 2, 3, 4, 5, 6, 7, 8], BLOCK, parent=a[0], start_block=1)
    assert resumed == a[1:]


def test_second_reader_shares_blocks_zero_copy() -> None:
    manager = make_manager()
    doc = list(range(100, 113))  # 3 full blocks + 1 token
    first, cached_first = run_prefill(manager, doc)
    second, cached_second = run_prefill(manager, doc)
    assert cached_first == 0 and cached_second == 12
    assert first.block_table[:3] == second.block_table[:3]  # the same physical blocks
    assert first.block_table[3] != second.block_table[3]  # the partial block stays private
    pool = manager.pool
    assert [pool.ref_counts[b] for b in first.block_table[:3]] == [2, 2, 2]
    pool.check_invariants([first.block_table, second.block_table])
    manager.free(first)
    manager.free(second)
    pool.check_invariants()
    assert pool.num_cached == 3 and pool.num_free == pool.num_blocks


def test_whole_prompt_cached_still_leaves_a_token_to_compute() -> None:
    manager = make_manager()
    prompt = list(range(8))  # exactly two blocks
    first, _ = run_prefill(manager, prompt)
    alloc = KVAllocation(salt=SALT)
    manager.update_hashes(alloc, prompt)
    assert manager.match_prefix(alloc, prompt, 0) == 4  # the last block is recomputed
    manager.free(alloc)
    manager.free(first)


def test_namespaces_never_share() -> None:
    manager = make_manager()
    doc = list(range(8))
    first, _ = run_prefill(manager, doc + [1])
    _, cached = run_prefill(manager, doc + [1], salt=make_salt("test-model", BLOCK, "float32", "b"))
    assert cached == 0
    _, cached_same = run_prefill(manager, doc + [1])
    assert cached_same == 8
    del first


def test_forced_hash_collision_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "hash_block", lambda salt, parent, data: b"\x01" * 16)
    manager = make_manager()
    first, _ = run_prefill(manager, [1, 2, 3, 4, 5])
    other, cached = run_prefill(manager, [9, 9, 9, 9, 5])
    assert cached == 0, "a colliding hash with other tokens must not be served"
    assert other.block_table[0] != first.block_table[0]
    manager.pool.check_invariants([first.block_table, other.block_table])


def test_a_collision_past_the_first_block_ends_the_shared_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A hash of the block's tokens alone: equal blocks after different prefixes collide.
    monkeypatch.setattr(hashing, "hash_block", lambda salt, parent, data: data.ljust(16, b"\0"))
    manager = make_manager()
    first, _ = run_prefill(manager, [1] * 4 + [2] * 4)
    second, _ = run_prefill(manager, [5] * 4 + [2] * 4)  # its second block is not indexed
    third, cached = run_prefill(manager, [5] * 4 + [2] * 4 + [7])
    assert cached == 4, "the second block's hash names the first sequence's block"
    assert third.block_table[0] == second.block_table[0]
    assert third.block_table[1] not in (first.block_table[1], second.block_table[1])
    manager.pool.check_invariants([first.block_table, second.block_table, third.block_table])


def test_lru_eviction_order_and_hook() -> None:
    manager = make_manager(num_blocks=4)
    evicted: list[tuple[int, ...]] = []
    manager.pool.add_eviction_hook(lambda block, identity: evicted.append(identity.token_ids))
    a, _ = run_prefill(manager, [1, 1, 1, 1, 2, 2, 2, 2])
    manager.free(a)  # releases tail first: block [2,2,2,2] is evicted before [1,1,1,1]
    b, _ = run_prefill(manager, [3, 3, 3, 3, 4, 4, 4, 4, 5])
    assert evicted == [(2, 2, 2, 2)]
    manager.free(b)
    first_hash, second_hash = hash_full_blocks(SALT, [1] * 4 + [2] * 4, BLOCK)
    assert manager.pool.cached_identity(second_hash) is None
    assert manager.pool.cached_identity(first_hash) is not None


def test_allocation_beyond_capacity_fails_cleanly() -> None:
    manager = make_manager(num_blocks=2)
    alloc = KVAllocation(salt=SALT)
    assert not manager.allocate(alloc, 3 * BLOCK)
    assert alloc.block_table == [] and manager.pool.num_free == 2
    with pytest.raises(NoFreeBlocksError):
        manager.pool.allocate(3)


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / append / share / finish / evict sequences keep every invariant."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = make_manager(num_blocks=12)
        self.live: list[tuple[KVAllocation, list[int]]] = []

    @rule(
        prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]]),
        tail=st.lists(st.integers(0, 3), min_size=1, max_size=9),
    )
    def admit(self, prefix: list[int], tail: list[int]) -> None:
        tokens = prefix + tail
        alloc = KVAllocation(salt=SALT)
        self.manager.update_hashes(alloc, tokens)
        self.manager.match_prefix(alloc, tokens, 0)
        if self.manager.allocate(alloc, len(tokens)):
            self.manager.commit(alloc, tokens, len(tokens))
            self.live.append((alloc, tokens))
        else:
            self.manager.free(alloc)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def append_token(self, data: st.DataObject) -> None:
        alloc, tokens = data.draw(st.sampled_from(self.live))
        tokens.append(data.draw(st.integers(0, 3)))
        self.manager.update_hashes(alloc, tokens)
        if self.manager.allocate(alloc, len(tokens)):
            self.manager.commit(alloc, tokens, len(tokens))
        else:
            tokens.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.live) - 1))
        alloc, _ = self.live.pop(index)
        self.manager.free(alloc)

    @rule()
    def evict_free(self) -> None:
        self.manager.reset_prefix_cache()

    @invariant()
    def pool_is_consistent(self) -> None:
        pool = self.manager.pool
        pool.check_invariants([alloc.block_table for alloc, _ in self.live])
        for alloc, tokens in self.live:  # every indexed block a sequence holds has its tokens
            for index, block in enumerate(alloc.block_table[: alloc.num_registered]):
                identity = pool.identities[block]
                if identity is not None and identity.block_hash == alloc.block_hashes[index]:
                    assert identity.token_ids == tuple(tokens[index * BLOCK : (index + 1) * BLOCK])

    def teardown(self) -> None:
        for alloc, _ in self.live:
            self.manager.free(alloc)
        self.manager.pool.check_invariants()
        assert all(count == 0 for count in self.manager.pool.ref_counts)


TestPoolMachine = pytest.mark.slow(PoolMachine.TestCase)
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
