"""CPU attention backends on one layer's work, by thread count: ``python -m kernels.bench_cpu_attention``.

Cases: a fresh 2,048-token prefill, a 2,048-token chunk over 6,144 cached tokens, a
20-token question over 4,096, decodes of 32 sequences over 300 and one over 4,096, on
blocks scattered through a 30-layer cache. Each backend's best of ``--repeats`` wall
times, interleaved; GFLOP/s counts the causal attention's useful multiply-adds.

By default a repeat runs one layer, whose K/V stay in cache from the last repeat. With
``--every-layer`` it runs every layer of the cache once, as a model step does, so K/V come
from memory. GB/s counts the K/V bytes a repeat reads.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import torch

from kernels.cpu_backend import CpuBackend
from kernels.interface import AttentionMetadata
from kernels.reference import ReferenceBackend

CASES = {
    "prefill 2048": ([2048], [2048]),
    "chunk 2048 over 6144": ([2048], [8192]),
    "question 20 over 4096": ([20], [4116]),
    "decode 32 x 300": ([1] * 32, [300] * 32),
    "decode 1 x 4096": ([1], [4096]),
}
SHAPES = {"smollm2": (9, 3, 64), "llama-8b": (32, 8, 128)}


def make_meta(
    query_lens: list[int], seq_lens: list[int], block_size: int, rng: random.Random
) -> tuple[AttentionMetadata, int]:
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 1
    free = list(range(num_blocks))
    rng.shuffle(free)
    rows, slots = [], []
    for query_len, seq_len in zip(query_lens, seq_lens, strict=True):
        blocks = [free.pop() for _ in range(-(-seq_len // block_size))]
        rows.append(blocks)
        slots += [
            blocks[p // block_size] * block_size + p % block_size
            for p in range(seq_len - query_len, seq_len)
        ]
    table = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.int32)
    for i, blocks in enumerate(rows):
        table[i, : len(blocks)] = torch.tensor(blocks)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        torch.tensor(slots),
        starts,
        torch.tensor(seq_lens, dtype=torch.int32),
        table,
        list(query_lens),
        list(seq_lens),
        max(query_lens),
        max(seq_lens),
    )
    return meta, num_blocks


def flops(query_lens: list[int], seq_lens: list[int], heads: int, dim: int) -> float:
    visits = sum(q * (s - q) + q * (q + 1) / 2 for q, s in zip(query_lens, seq_lens, strict=True))
    return 4.0 * visits * heads * dim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--threads", default=str(torch.get_num_threads()), help="comma-separated thread counts"
    )
    parser.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--backends", default="native,torch,reference")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--layers", type=int, default=30, help="layers in the cache (sets the block stride)"
    )
    parser.add_argument(
        "--every-layer", action="store_true", help="a repeat runs every layer (K/V from memory)"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    heads, kv_heads, dim = SHAPES[args.shape]
    dtype = getattr(torch, args.dtype)
    makers = {
        "native": CpuBackend,
        "torch": lambda: CpuBackend(native=False),
        "reference": ReferenceBackend,
    }
    names = [n for n in args.backends.split(",") if n]
    results: list[dict[str, Any]] = []
    layers = range(args.layers) if args.every_layer else range(1)
    unit = f"{args.layers} layers" if args.every_layer else "one layer"
    print(f"{args.shape} {args.dtype}, {unit}: best wall ms (GFLOP/s; K/V GB/s)")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for case, (query_lens, seq_lens) in CASES.items():
            meta, num_blocks = make_meta(query_lens, seq_lens, 16, random.Random(0))
            cache = torch.randn(num_blocks, args.layers, 2, 16, kv_heads, dim).to(dtype)
            qkv = torch.randn(sum(query_lens), heads + 2 * kv_heads, dim).to(dtype)
            query, key, value = qkv.split([heads, kv_heads, kv_heads], dim=1)
            backends = {n: makers[n]() for n in names}
            best = dict.fromkeys(names, float("inf"))
            for _ in range(args.repeats):
                for name, backend in backends.items():
                    started = time.perf_counter()
                    for layer in layers:
                        backend.forward(query, key, value, cache[:, layer], meta, dim**-0.5)
                    best[name] = min(best[name], time.perf_counter() - started)
            work = flops(query_lens, seq_lens, heads, dim) * len(layers)
            kv_bytes = sum(seq_lens) * 2 * kv_heads * dim * cache.element_size() * len(layers)
            cells = "  ".join(
                f"{n} {best[n] * 1e3:8.2f} ({work / best[n] / 1e9:5.1f}; "
                f"{kv_bytes / best[n] / 1e9:4.1f})"
                for n in names
            )
            print(f"threads {threads:3d}  {case:22s} {cells}", flush=True)
            results.append(
                {
                    "threads": threads,
                    "case": case,
                    "layers": len(layers),
                    **{f"{n}_ms": best[n] * 1e3 for n in names},
                }
            )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {"shape": args.shape, "dtype": args.dtype, "results": results}, handle, indent=1
            )


if __name__ == "__main__":
    main()
