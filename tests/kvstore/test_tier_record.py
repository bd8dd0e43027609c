"""The on-disk record format: exact round trips, and every damage detected and classified."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch
import xxhash

from kvstore.record_format import (
    FORMAT_VERSION,
    MAGIC,
    PREFIX,
    RecordError,
    decode_head,
    decode_record,
    encode_head,
    encode_record,
    tensor_bytes,
)
from kvstore.tier import BlockMeta, record_key, salt_fingerprint, same_block

SHAPE = (2, 2, 4, 2, 8)
SALT = xxhash.xxh3_128_digest(b"model-a|bs=4|float32|tenant-1")


def make_meta(index: int, salt: bytes = SALT) -> BlockMeta:
    parent = (
        None if index == 0 else xxhash.xxh3_128_digest(salt + (index - 1).to_bytes(8, "little"))
    )
    return BlockMeta(
        block_hash=xxhash.xxh3_128_digest(salt + index.to_bytes(8, "little")),
        parent_hash=parent,
        token_ids=tuple(range(index * 4, index * 4 + 4)),
        salt=salt,
    )


def random_block(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=generator).to(dtype)


def as_bytes(block: torch.Tensor) -> bytes:
    return tensor_bytes(block.contiguous()).tobytes()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    block = random_block(dtype, seed=3)
    meta = make_meta(5)
    record = encode_record(meta, block)
    payload = decode_record(record, meta, dtype, SHAPE)
    assert bytes(payload) == as_bytes(block)
    assert record.startswith(MAGIC)
    restored = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(SHAPE)
    assert torch.equal(restored.view(torch.uint8), block.view(torch.uint8))


def test_header_fields_are_decoded() -> None:
    block = random_block(torch.bfloat16)
    meta = make_meta(2)
    record = encode_record(meta, block)
    header = decode_head(record[: len(record) - block.numel() * 2])
    assert header.version == FORMAT_VERSION
    assert header.block_hash == meta.block_hash
    assert header.parent_hash == meta.parent_hash
    assert header.token_ids == meta.token_ids
    assert header.salt == SALT
    assert (header.dtype, header.shape) == ("bfloat16", SHAPE)
    assert header.payload_len == block.numel() * 2


def test_every_single_byte_flip_is_detected() -> None:
    block = random_block(torch.float32, seed=1)
    meta = make_meta(1)
    record = bytearray(encode_record(meta, block))
    for position in range(len(record)):
        damaged = bytearray(record)
        damaged[position] ^= 0x40
        with pytest.raises(RecordError) as caught:
            decode_record(damaged, meta, torch.float32, SHAPE)
        assert caught.value.kind == "corrupt", (position, caught.value)


@pytest.mark.parametrize("cut", [1, 7, 100, 1024, 1030])
def test_truncated_record_is_corrupt(cut: int) -> None:
    block = random_block(torch.float32)
    meta = make_meta(0)
    record = encode_record(meta, block)
    with pytest.raises(RecordError) as caught:
        decode_record(record[: len(record) - cut], meta, torch.float32, SHAPE)
    assert caught.value.kind == "corrupt"


def test_extended_record_is_corrupt() -> None:
    meta = make_meta(0)
    record = encode_record(meta, random_block(torch.float32))
    with pytest.raises(RecordError, match="header length"):
        decode_record(record + b"\0", meta, torch.float32, SHAPE)


def test_other_format_version_is_foreign() -> None:
    block = random_block(torch.float32)
    meta = make_meta(0)
    payload = tensor_bytes(block)
    record = encode_head(meta, block.dtype, SHAPE, payload, version=FORMAT_VERSION + 1)
    with pytest.raises(RecordError, match="format version") as caught:
        decode_record(record + payload.tobytes(), meta, torch.float32, SHAPE)
    assert caught.value.kind == "foreign"


def test_other_salt_is_foreign() -> None:
    meta = make_meta(0)
    stranger = dataclasses.replace(meta, salt=xxhash.xxh3_128_digest(b"tenant-2"))
    record = encode_record(stranger, random_block(torch.float32))
    with pytest.raises(RecordError, match="salt") as caught:
        decode_record(record, meta, torch.float32, SHAPE)
    assert caught.value.kind == "foreign"


@pytest.mark.parametrize(
    ("change", "pattern"),
    [
        ({"token_ids": (9, 9, 9, 9)}, "token ids"),
        ({"block_hash": b"\x01" * 16}, "hash"),
        ({"parent_hash": b"\x02" * 16}, "parent"),
    ],
)
def test_other_block_is_a_mismatch(change: dict[str, object], pattern: str) -> None:
    meta = make_meta(3)
    record = encode_record(meta, random_block(torch.float32))
    expected = dataclasses.replace(meta, **change)  # type: ignore[arg-type]
    with pytest.raises(RecordError, match=pattern) as caught:
        decode_record(record, expected, torch.float32, SHAPE)
    assert caught.value.kind == "mismatch"


def test_other_layout_is_a_mismatch() -> None:
    meta = make_meta(0)
    record = encode_record(meta, random_block(torch.bfloat16))
    with pytest.raises(RecordError, match="layout") as caught:
        decode_record(record, meta, torch.float16, SHAPE)  # same size, other dtype
    assert caught.value.kind == "mismatch"
    with pytest.raises(RecordError, match="layout"):
        decode_record(record, meta, torch.bfloat16, (2, 2, 4, 8, 2))


def test_well_checksummed_but_malformed_header_is_corrupt() -> None:
    header = msgpack.packb({"v": FORMAT_VERSION, "hash": "not bytes"}, use_bin_type=True)
    head = PREFIX.pack(MAGIC, len(header), xxhash.xxh3_64_intdigest(header)) + header
    with pytest.raises(RecordError, match="malformed") as caught:
        decode_head(head)
    assert caught.value.kind == "corrupt"
    garbage = b"\xc1\xc1\xc1"  # never-used msgpack type byte
    head = PREFIX.pack(MAGIC, len(garbage), xxhash.xxh3_64_intdigest(garbage)) + garbage
    with pytest.raises(RecordError, match="undecodable"):
        decode_head(head)


def test_block_meta_validates_and_keys() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        BlockMeta(b"short", None, (1, 2), SALT)
    meta = BlockMeta(b"\x03" * 16, b"\x04" * 16, [1, 2, 3], SALT)  # type: ignore[arg-type]
    assert meta.token_ids == (1, 2, 3)
    assert record_key(meta).fingerprint == salt_fingerprint(SALT)
    assert len(salt_fingerprint(SALT)) == 16


def test_any_block_identity_shape_is_accepted() -> None:
    @dataclasses.dataclass(frozen=True)
    class PoolIdentity:  # the block pool's own record type, structurally a BlockLike
        block_hash: bytes
        parent_hash: bytes
        salt: bytes
        token_ids: tuple[int, ...]

    meta = make_meta(4)
    assert meta.parent_hash is not None
    identity = PoolIdentity(meta.block_hash, meta.parent_hash, SALT, meta.token_ids)
    assert same_block(identity, meta)
    assert not same_block(dataclasses.replace(identity, token_ids=(0, 0, 0, 0)), meta)
    record = encode_record(identity, random_block(torch.float32))
    assert len(decode_record(record, meta, torch.float32, SHAPE)) == 256 * 4
