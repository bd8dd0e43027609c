"""8-bit blocks (``head_dim + 4`` bytes per head, scales inside: e4m3 codes in uint8, int8
codes in int8) in disk records: bit-exact round trips, and never served to a tier of
another layout even under the same hash."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.fp8_kv import dequantize_slots, quantize_slots
from kvstore.disk_tier import DiskTier
from tests.kvstore.tier_blocks import SHAPE, bit_equal, make_meta, random_block

FP8_SHAPE = (*SHAPE[:-1], SHAPE[-1] + 4)
FORMATS = pytest.mark.parametrize("storage", [torch.uint8, torch.int8], ids=["fp8", "int8"])


def fp8_block(seed: int, storage: torch.dtype = torch.uint8) -> torch.Tensor:
    return quantize_slots(random_block(torch.float32, seed), storage)


@FORMATS
def test_8bit_records_round_trip_bit_exact_scales_included(
    tmp_path: Path, storage: torch.dtype
) -> None:
    blocks = [fp8_block(index, storage) for index in range(3)]
    with DiskTier(FP8_SHAPE, storage, 1 << 20, tmp_path) as tier:
        for index, block in enumerate(blocks):
            assert tier.put(make_meta(index), block, blocking=True)
        tier.flush()
    with DiskTier(FP8_SHAPE, storage, 1 << 20, tmp_path) as reopened:  # a restart
        for index, block in enumerate(blocks):
            dest = torch.full(FP8_SHAPE, 0x2B, dtype=storage)
            assert reopened.load_into(make_meta(index), dest)
            assert bit_equal(dest, block)
            assert torch.equal(
                dequantize_slots(dest, torch.float32), dequantize_slots(block, torch.float32)
            )


def test_an_fp8_record_is_a_miss_for_a_float32_tier_even_under_the_same_hash(
    tmp_path: Path,
) -> None:
    """The salt already keeps FP8 and float32 hashes apart; the record's layout check is
    the second guard: a float32 tier never reads FP8 bytes as floats."""
    with DiskTier(FP8_SHAPE, torch.uint8, 1 << 20, tmp_path) as fp8:
        assert fp8.put(make_meta(0), fp8_block(0), blocking=True)
        fp8.flush()
    with DiskTier(SHAPE, torch.float32, 1 << 20, tmp_path) as plain:
        dest = torch.zeros(SHAPE)
        assert not plain.load_into(make_meta(0), dest)
        assert not dest.any()
        metrics = plain.metrics()
        # Seen and refused (its size fits no float32 block), not merely absent.
        assert (metrics.hits, metrics.misses) == (0, 1)
        assert metrics.corrupt_records + metrics.mismatched_records == 1


@pytest.mark.parametrize(
    ("written", "read"), [(torch.uint8, torch.int8), (torch.int8, torch.uint8)], ids=["fp8", "int8"]
)
def test_an_8bit_record_is_a_miss_for_a_tier_of_the_other_8bit_format(
    tmp_path: Path, written: torch.dtype, read: torch.dtype
) -> None:
    """e4m3 and int8 blocks have the same shape and bytes: only the salt (distinct format
    names) and the record's dtype keep one from being read as the other."""
    with DiskTier(FP8_SHAPE, written, 1 << 20, tmp_path) as writer:
        assert writer.put(make_meta(0), fp8_block(0, written), blocking=True)
        writer.flush()
    with DiskTier(FP8_SHAPE, read, 1 << 20, tmp_path) as reader:
        # NOTE: a same-sized record is read straight into ``dest`` before its header is
        # checked: what matters is the refusal (a miss leaves ``dest`` undefined).
        assert not reader.load_into(make_meta(0), torch.zeros(FP8_SHAPE, dtype=read))
        metrics = reader.metrics()
        assert (metrics.hits, metrics.misses, metrics.mismatched_records) == (0, 1, 1)
