"""Tier restore throughput without a model: the disk tier plain against encrypted
records, or the remote tier against the store's raw reads of the same values.

``python -m kvstore.restore_bench [--blocks N] [--block-kib K] [--repeats R]`` writes N
records of one block shape to a temporary directory twice (plain, then sealed under a
random key), reads them all back with ``load_many_into`` (the engine's restore path,
verification included) R times each, and prints the best GB/s of each and their ratio.
The page cache is warm: this isolates the CPU cost of verifying and opening records.

``--remote-url redis://HOST:PORT/DB`` measures the remote tier instead: N blocks are
written to the store, then, R times in turn, read back raw (MGETs of the same keys in the
tier's batches, bytes only) and restored by the tier (the same MGETs, plus verification
and the copy into a block-major tensor). It prints the best GB/s of each, over the same
bytes (the values), and their ratio. The keys are deleted afterwards.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from kvstore.disk_tier import DiskTier
from kvstore.record_cipher import RecordCipher
from kvstore.remote_keys import block_key
from kvstore.remote_tier import RemoteTier
from kvstore.tier import BlockMeta


def _metas(count: int, block_tokens: int) -> list[BlockMeta]:
    salt = b"restore-bench-salt"
    return [
        BlockMeta(
            index.to_bytes(16, "little"), None, tuple(range(index, index + block_tokens)), salt
        )
        for index in range(count)
    ]


def measure(
    blocks: int, shape: tuple[int, ...], repeats: int, cipher: RecordCipher | None
) -> float:
    """Best restore rate in GB/s (payload bytes over wall time of one batched load)."""
    metas = _metas(blocks, shape[2])
    data = torch.randn((blocks, *shape))
    with (
        tempfile.TemporaryDirectory() as root,
        DiskTier(shape, torch.float32, 1 << 40, root, cipher=cipher, fsync=False) as tier,
    ):
        for meta, block in zip(metas, data, strict=True):
            assert tier.put(meta, block, blocking=True)
        tier.flush()
        dest = torch.empty_like(data)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            found = tier.load_many_into(metas, dest)
            best = min(best, time.perf_counter() - start)
            assert all(found) and torch.equal(dest, data)
    return data.numel() * data.element_size() / best / 1e9


def measure_remote(
    url: str, blocks: int, shape: tuple[int, ...], repeats: int, batch_blocks: int
) -> tuple[float, float]:
    """(tier restore GB/s, raw MGET GB/s), both over the bytes of the stored values."""
    metas = _metas(blocks, shape[2])
    data = torch.randn((blocks, *shape))
    with RemoteTier(
        shape, torch.float32, url, batch_blocks=batch_blocks, max_pending_writes=blocks
    ) as tier:
        keys = [block_key(tier.key_prefix, meta) for meta in metas]
        client = tier.store.client
        try:
            for meta, block in zip(metas, data, strict=True):
                assert tier.put(meta, block, blocking=True)
            tier.flush()
            value_bytes = sum(int(client.strlen(key)) for key in keys)
            assert value_bytes > data.numel() * data.element_size(), "writes were dropped"
            dest = torch.empty_like(data)
            best_raw = best_tier = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                for first in range(0, blocks, batch_blocks):
                    values = client.mget(keys[first : first + batch_blocks])
                    assert all(value is not None for value in values)
                best_raw = min(best_raw, time.perf_counter() - start)
                start = time.perf_counter()
                found = tier.load_many_into(metas, dest)
                best_tier = min(best_tier, time.perf_counter() - start)
                assert all(found) and torch.equal(dest, data)
        finally:
            for first in range(0, blocks, 512):
                client.delete(*keys[first : first + 512])
    return value_bytes / best_tier / 1e9, value_bytes / best_raw / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--block-kib", type=int, default=1536, help="bytes of one block, KiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--remote-url", default=None, help="measure the remote tier in this store instead"
    )
    parser.add_argument("--batch-blocks", type=int, default=64, help="blocks per MGET (remote)")
    args = parser.parse_args()
    # layers, K/V, 16 tokens, heads, head_dim: float32 elements adding up to --block-kib
    elements = args.block_kib * 1024 // 4
    shape = (elements // (2 * 16 * 64), 2, 16, 1, 64)
    if args.remote_url:
        tier, raw = measure_remote(
            args.remote_url, args.blocks, shape, args.repeats, args.batch_blocks
        )
        print(f"{args.blocks} blocks of {args.block_kib} KiB: remote restore {tier:.2f} GB/s, "
              f"raw MGET {raw:.2f} GB/s, ratio {tier / raw:.0%}")  # fmt: skip
        return
    plain = measure(args.blocks, shape, args.repeats, None)
    cipher = RecordCipher(os.urandom(32))
    sealed = measure(args.blocks, shape, args.repeats, cipher)
    print(f"{args.blocks} blocks of {args.block_kib} KiB: plain {plain:.2f} GB/s, "
          f"encrypted {sealed:.2f} GB/s ({cipher.implementation} AES-GCM), "
          f"ratio {sealed / plain:.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
