"""Disk-tier restore throughput, plain against encrypted records, without a model.

``python -m kvstore.restore_bench [--blocks N] [--block-kib K] [--repeats R]`` writes N
records of one block shape to a temporary directory twice (plain, then sealed under a
random key), reads them all back with ``load_many_into`` (the engine's restore path,
verification included) R times each, and prints the best GB/s of each and their ratio.
The page cache is warm: this isolates the CPU cost of verifying and opening records.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from kvstore.disk_tier import DiskTier
from kvstore.record_cipher import RecordCipher
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--block-kib", type=int, default=1536, help="bytes of one block, KiB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    # layers, K/V, 16 tokens, heads, head_dim: float32 elements adding up to --block-kib
    elements = args.block_kib * 1024 // 4
    shape = (elements // (2 * 16 * 64), 2, 16, 1, 64)
    plain = measure(args.blocks, shape, args.repeats, None)
    cipher = RecordCipher(os.urandom(32))
    sealed = measure(args.blocks, shape, args.repeats, cipher)
    print(f"{args.blocks} blocks of {args.block_kib} KiB: plain {plain:.2f} GB/s, "
          f"encrypted {sealed:.2f} GB/s ({cipher.implementation} AES-GCM), "
          f"ratio {sealed / plain:.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
