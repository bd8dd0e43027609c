"""The remote tier against a real valkey-server on loopback: round trips, one round trip
per batch, verification of what the store returns, tenants, the store's own eviction."""

from __future__ import annotations

import os
import time

import pytest
import redis
import torch

from kvstore.record_cipher import RecordCipher
from kvstore.record_format import decode_head
from kvstore.remote_keys import block_key
from kvstore.remote_tier import RemoteTier
from kvstore.tier import BlockMeta, salt_fingerprint
from tests.kvstore.tier_blocks import SALT, SHAPE, bit_equal, make_meta, random_block
from tests.valkey_server import ValkeyServer

PREFIX = "ragserve:kv:v1"


def calls(client: redis.Redis, command: str) -> int:
    """How many times the store ran ``command`` (its own statistics)."""
    stats = client.info("commandstats").get(f"cmdstat_{command}")
    return int(stats["calls"]) if stats else 0


def fill(tier: RemoteTier, indices: range | list[int], dtype: torch.dtype = torch.float32) -> None:
    for index in indices:
        assert tier.put(make_meta(index), random_block(dtype, index), blocking=True)
    tier.flush()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact(valkey: ValkeyServer, dtype: torch.dtype) -> None:
    with RemoteTier(SHAPE, dtype, valkey.url) as tier:
        fill(tier, range(4), dtype)
        for index in range(4):
            dest = torch.full(SHAPE, 3.0, dtype=dtype)
            assert tier.load_into(make_meta(index), dest)
            assert bit_equal(dest, random_block(dtype, index))
        assert not tier.load_into(make_meta(99), torch.empty(SHAPE, dtype=dtype))
        stats = tier.metrics()
    assert (stats.hits, stats.misses, stats.store_count) == (4, 1, 4)
    assert stats.bytes_read == stats.bytes_written > 4 * random_block(dtype, 0).nbytes
    assert stats.capacity_bytes == 256 * 2**20 and stats.errors == 0
    # One key per block, named by the salt's fingerprint and the block hash; the value is
    # a verified record.
    keys = sorted(valkey.client().keys("*"))
    assert keys == sorted(
        f"{PREFIX}:{salt_fingerprint(SALT)}:{make_meta(i).block_hash.hex()}".encode()
        for i in range(4)
    )
    value = valkey.client().get(keys[0])
    assert value is not None
    head = decode_head(value[: len(value) - random_block(dtype, 0).nbytes])
    assert head.salt == SALT and len(head.token_ids) == SHAPE[2]


def test_a_run_of_blocks_is_read_in_one_round_trip(valkey: ValkeyServer) -> None:
    client = valkey.client()
    with RemoteTier(SHAPE, torch.float32, valkey.url, batch_blocks=8) as tier:
        fill(tier, range(12))
        metas = [make_meta(index) for index in [*range(12), 50]]
        before = calls(client, "mget"), calls(client, "get")
        dest = torch.zeros((13, *SHAPE))
        assert tier.load_many_into(metas, dest) == [True] * 12 + [False]
        assert (calls(client, "mget") - before[0], calls(client, "get") - before[1]) == (2, 0)
        for index in range(12):
            assert bit_equal(dest[index], random_block(torch.float32, index))
        # A non-contiguous destination is filled through a host copy.
        strided = torch.zeros(tuple(reversed(SHAPE))).permute(4, 3, 2, 1, 0)
        assert tier.load_rows_into([make_meta(3)], strided.unsqueeze(0), [0]) == [True]
        assert bit_equal(strided, random_block(torch.float32, 3))


def test_blocks_written_by_another_engine_are_found(valkey: ValkeyServer) -> None:
    with RemoteTier(SHAPE, torch.float32, valkey.url) as writer:
        fill(writer, range(6))
    client = valkey.client()
    with RemoteTier(SHAPE, torch.float32, valkey.url) as reader:
        before = calls(client, "exists")
        assert reader.contains_many([make_meta(i) for i in range(8)]) == [True] * 6 + [False] * 2
        assert calls(client, "exists") - before == 8  # one pipeline
        assert reader.contains(make_meta(2))  # known now: no round trip
        assert calls(client, "exists") - before == 8
        dest = torch.empty((6, *SHAPE))
        assert reader.load_many_into([make_meta(i) for i in range(6)], dest) == [True] * 6


def test_blocks_the_store_lost_are_written_again_once_the_belief_lapses(
    valkey: ValkeyServer,
) -> None:
    """A store that evicts or restarts empty, with no error seen: the tier's belief that it
    holds a block lapses, and the next put of the block writes it again; a put of a block
    the store still holds sends no second copy."""
    client = valkey.client()
    sets = calls(client, "set")
    with RemoteTier(SHAPE, torch.float32, valkey.url, known_for_s=0.2) as tier:
        fill(tier, range(4))
        assert client.dbsize() == 4 and calls(client, "set") - sets == 4
        client.flushall()
        fill(tier, range(4))  # believed present: skipped
        assert client.dbsize() == 0 and tier.contains(make_meta(0))
        time.sleep(0.3)
        fill(tier, range(4))
        assert client.dbsize() == 4 and calls(client, "set") - sets == 8
        time.sleep(0.3)
        fill(tier, range(4))  # asked, and found: not sent again
        assert calls(client, "set") - sets == 8
    with RemoteTier(SHAPE, torch.float32, valkey.url) as reader:
        for index in range(4):
            dest = torch.empty(SHAPE)
            assert reader.load_into(make_meta(index), dest)
            assert bit_equal(dest, random_block(torch.float32, index))


@pytest.mark.parametrize(
    "damage", ["garbage", "flipped payload byte", "another block's record", "truncated"]
)
def test_bad_values_are_misses_and_deleted(valkey: ValkeyServer, damage: str) -> None:
    client = valkey.client()
    with RemoteTier(SHAPE, torch.float32, valkey.url) as tier:
        fill(tier, range(3))
        key = block_key(PREFIX, make_meta(1))
        value = client.get(key)
        assert isinstance(value, bytes)
        if damage == "garbage":
            bad = b"not a record" * 100
        elif damage == "flipped payload byte":
            bad = value[:-7] + bytes([value[-7] ^ 0x01]) + value[-6:]
        elif damage == "another block's record":
            other = client.get(block_key(PREFIX, make_meta(2)))
            assert isinstance(other, bytes)
            bad = other
        else:
            bad = value[: len(value) // 2]
        client.set(key, bad)
        dest = torch.zeros((3, *SHAPE))
        assert tier.load_many_into([make_meta(i) for i in range(3)], dest) == [True, False, True]
        assert client.exists(key) == 0
        stats = tier.metrics()
        assert stats.corrupt_records + stats.mismatched_records + stats.foreign_records == 1
        assert stats.misses == 1 and stats.hits == 2
        # The miss is remembered: a sequence waiting for this block computes it instead.
        assert not tier.contains(make_meta(1))


def test_tenants_never_read_each_other(valkey: ValkeyServer) -> None:
    other_salt = b"another-tenant-salt-bytes"

    def as_tenant_b(index: int) -> BlockMeta:
        meta = make_meta(index)
        return BlockMeta(meta.block_hash, meta.parent_hash, meta.token_ids, other_salt)

    client = valkey.client()
    with RemoteTier(SHAPE, torch.float32, valkey.url) as tier:
        fill(tier, range(2))
        # Same hash and tokens under tenant B's salt: another key, nothing there.
        assert not tier.contains(as_tenant_b(0))
        assert not tier.load_into(as_tenant_b(0), torch.empty(SHAPE))
        # Tenant A's record copied under tenant B's key: foreign, never served.
        client.set(block_key(PREFIX, as_tenant_b(0)), client.get(block_key(PREFIX, make_meta(0))))
        tier._known.forget(block_key(PREFIX, as_tenant_b(0)))
        assert not tier.load_into(as_tenant_b(0), torch.empty(SHAPE))
        assert tier.metrics().foreign_records == 1
        assert client.exists(block_key(PREFIX, as_tenant_b(0))) == 0
        assert tier.load_into(make_meta(0), torch.empty(SHAPE))


def test_encrypted_values_need_the_key_and_live_apart_by_it(valkey: ValkeyServer) -> None:
    """Engines of one model and tenant with another key, or none, share the store without
    touching each other's records (a rolling change of key, two deployments)."""
    master = os.urandom(32)
    cipher = RecordCipher(master)
    client = valkey.client()
    sealed_key = block_key(f"{PREFIX}:sealed-{cipher.key_id}", make_meta(0))
    with RemoteTier(SHAPE, torch.float32, valkey.url, cipher=cipher) as sealed:
        fill(sealed, range(2))
        value = client.get(sealed_key)
        assert isinstance(value, bytes)
        assert random_block(torch.float32, 0).numpy().tobytes() not in value
        dest = torch.empty(SHAPE)
        assert sealed.load_into(make_meta(0), dest)
        assert bit_equal(dest, random_block(torch.float32, 0))
    other_key = RemoteTier(SHAPE, torch.float32, valkey.url, cipher=RecordCipher(os.urandom(32)))
    for other in (other_key, RemoteTier(SHAPE, torch.float32, valkey.url)):
        with other:
            assert not other.contains(make_meta(1))
            assert not other.load_into(make_meta(1), torch.empty(SHAPE))
            fill(other, range(1))  # its own copy, beside the sealed one
            assert other.metrics().foreign_records == other.metrics().corrupt_records == 0
    assert client.dbsize() == 4  # two sealed, one under the other key, one plain
    with RemoteTier(SHAPE, torch.float32, valkey.url, cipher=RecordCipher(master)) as same:
        assert same.load_into(make_meta(1), dest)
        assert bit_equal(dest, random_block(torch.float32, 1))


def test_values_the_store_evicted_are_misses(tmp_path: object) -> None:
    from pathlib import Path

    directory = Path(str(tmp_path)) / "small"
    directory.mkdir()
    server = ValkeyServer(directory, maxmemory="2mb")
    server.start()
    shape = (2, 2, 16, 2, 64)  # 32 KiB blocks: 200 of them are thrice the store's memory
    try:
        with RemoteTier(shape, torch.float32, server.url) as tier:
            blocks = {}
            for index in range(200):
                meta = make_meta(index)
                blocks[index] = torch.randn(shape, generator=torch.Generator().manual_seed(index))
                assert tier.put(meta, blocks[index], blocking=True)
            tier.flush()
            assert tier.metrics().write_errors == 0
            dest = torch.empty((200, *shape))
            found = tier.load_many_into([make_meta(i) for i in range(200)], dest)
            assert 0 < sum(found) < 200
            assert all(torch.equal(dest[i], blocks[i]) for i in range(200) if found[i])
            stats = tier.metrics()
            assert stats.corrupt_records == stats.errors == 0
            assert stats.capacity_bytes == 2 * 2**20
    finally:
        server.stop()


def test_block_links_and_purge(valkey: ValkeyServer) -> None:
    parent = make_meta(0)
    child = BlockMeta(make_meta(1).block_hash, parent.block_hash, make_meta(1).token_ids, SALT)
    with RemoteTier(SHAPE, torch.float32, valkey.url) as tier:
        assert tier.put(parent, random_block(torch.float32, 0), blocking=True)
        assert tier.put(child, random_block(torch.float32, 1), blocking=True)
        # A key of another type under the same prefix is passed over, not the whole list.
        odd = f"{PREFIX}:{salt_fingerprint(SALT)}:{'ab' * 16}"
        valkey.client().hset(odd, "field", "value")
        links = sorted(tier.block_links(salt_fingerprint(SALT)), key=lambda link: link[0])
        assert links == sorted(
            [(parent.block_hash, None), (child.block_hash, parent.block_hash)],
            key=lambda link: link[0],
        )
        assert tier.purge(salt_fingerprint(SALT), {child.block_hash}) == 1
        assert not tier.contains(child) and tier.contains(parent)
        assert tier.discard(parent) and valkey.client().keys("*") == [odd.encode()]


def test_flush_queued_keeps_its_time_limit_while_the_store_stalls(valkey: ValkeyServer) -> None:
    """A stalled store (writes paused, well within the client's time-out) makes the wait
    give up at its limit, then end once the write is through."""
    # NOTE: a time-out far above the pause: on a loaded machine the write still lands.
    with RemoteTier(SHAPE, torch.float32, valkey.url, batch_blocks=1, timeout_s=10.0) as tier:
        fill(tier, range(1))
        valkey.client().execute_command("CLIENT", "PAUSE", 450, "WRITE")
        assert tier.put(make_meta(1), random_block(torch.float32, 1), blocking=True)
        assert not tier.flush_queued(0.1)
        assert tier.flush_queued(30.0)
        dest = torch.empty(SHAPE)
        assert tier.load_into(make_meta(1), dest) and bit_equal(
            dest, random_block(torch.float32, 1)
        )
