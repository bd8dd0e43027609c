"""GPU microbenchmarks of the Triton attention, KV-write and block-copy kernels.

Run ``python -m kernels.bench_attention [--sections decode,prefill,...] [--json PATH]
[--kv-cache-dtype auto|fp8|int8]`` on a CUDA machine. Shapes are Llama-3.1-8B attention
(32 query heads, 8 KV heads, head_dim 128, bf16). Decode times are compared with torch
SDPA on contiguous K/V and with the memory floor (KV bytes read / 4.25 TB/s); prefill
with SDPA and the bf16 matmul rate. ``--kv-cache-dtype fp8`` (or ``int8``) runs the
paged-cache sections over an 8-bit cache (``kernels/fp8_kv.py``; floors count its
bytes); the ``fp8_kv`` section times decode, chunks over cached context and the KV write
over a bf16 and an 8-bit cache side by side (its "fp8" columns hold int8 codes under
``--kv-cache-dtype int8``, e4m3 ones otherwise).
"""

from __future__ import annotations

import argparse
import json
import math
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

from kernels.block_copy import gather_blocks, scatter_blocks
from kernels.fp8_kv import SCALE_BYTES, quantize_slots
from kernels.interface import AttentionMetadata, write_kv
from kernels.triton_attention import (
    DECODE_CONFIG,
    FP8_DECODE_CONFIG,
    FP8_MANY_DECODES_CONFIG,
    PREFILL_CONFIG,
    AttentionConfig,
    choose_num_splits,
    paged_attention,
)
from kernels.triton_backend import TritonBackend
from kernels.triton_kv_write import write_kv_triton

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DTYPE = torch.bfloat16
FLOOR_BYTES_PER_S = 4.25e12
SCALE = 1.0 / math.sqrt(HEAD_DIM)
Rows = list[dict[str, object]]
# ``--kv-cache-dtype``: the paged cache the sections build ("auto": bf16).
KV_CACHE_DTYPE = ["auto"]


def quantized_storage() -> torch.dtype:
    """The 8-bit caches' storage dtype: int8 codes under ``--kv-cache-dtype int8``, else e4m3."""
    return torch.int8 if KV_CACHE_DTYPE[0] == "int8" else torch.uint8


def time_us(fn: Callable[[], object]) -> float:
    """Median time of ``fn`` in microseconds (CUDA events, after warm-up, L2 flushed)."""
    return float(do_bench(fn, warmup=10, rep=60, return_mode="median")) * 1e3


def graph_us(fn: Callable[[], object]) -> float:
    """Median time of ``fn`` replayed from a CUDA graph, in microseconds.

    Decode steps run from CUDA graphs in the engine; eager timing of a ~20 us kernel
    would measure the Python launch path instead.
    """
    return float(do_bench_cudagraph(fn, rep=30, return_mode="median")) * 1e3


class Pool:
    """One random block pool (bf16, or its 8-bit slots); cases take random distinct blocks."""

    def __init__(self, num_tokens: int, block_size: int = 16, fp8: bool | None = None) -> None:
        self.block_size = block_size
        self.num_blocks = num_tokens // block_size + 1
        self.fp8 = KV_CACHE_DTYPE[0] != "auto" if fp8 is None else fp8
        shape = (self.num_blocks, 1, 2, block_size, KV_HEADS)
        if not self.fp8:
            self.cache = torch.randn(*shape, HEAD_DIM, device="cuda", dtype=DTYPE)
            return
        storage = quantized_storage()
        self.cache = torch.empty(*shape, HEAD_DIM + SCALE_BYTES, device="cuda", dtype=storage)
        step = 4096  # blocks quantized at a time: bounded float32 temporaries
        for start in range(0, self.num_blocks, step):
            part = self.cache[start : start + step]
            values = torch.randn(*part.shape[:-1], HEAD_DIM, device="cuda", dtype=DTYPE)
            part.copy_(quantize_slots(values, storage))

    def layer(self) -> torch.Tensor:
        return self.cache[:, 0]

    def metadata(self, seqs: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
        """Block tables over randomly placed blocks for ``(cached, new)`` token counts."""
        seq_lens = [c + q for c, q in seqs]
        per_seq = [-(-n // self.block_size) for n in seq_lens]
        ids = torch.randperm(self.num_blocks, device="cuda")[: sum(per_seq)].to(torch.int32)
        tables = torch.zeros(len(seqs), max(per_seq), dtype=torch.int32, device="cuda")
        start = 0
        for i, n in enumerate(per_seq):
            tables[i, :n] = ids[start : start + n]
            start += n
        starts = [0]
        for _, q in seqs:
            starts.append(starts[-1] + q)
        return {
            "block_tables": tables,
            "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
            "query_start_loc": torch.tensor(starts, dtype=torch.int32, device="cuda"),
        }


def attention_fn(
    pool: Pool,
    seqs: list[tuple[int, int]],
    num_splits: int | None = None,
    config: AttentionConfig | None = None,
) -> Callable[[], torch.Tensor]:
    """Paged attention over ``seqs``; successive calls cycle through block placements.

    NOTE: with a graph and no L2 flush between replays, a small context would stay in
    the 60 MB L2: enough placements that one cycle reads over 256 MB keep it honest.
    """
    num_tokens = sum(q for _, q in seqs)
    variants = max(1, min(64, 2**28 // kv_bytes(sum(c + q for c, q in seqs))))
    metas = [pool.metadata(seqs) for _ in range(variants)]
    query = torch.randn(num_tokens, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    out = torch.empty_like(query)
    max_q = max(q for _, q in seqs)
    max_s = max(c + q for c, q in seqs)
    calls = [0]

    def run() -> torch.Tensor:
        meta = metas[calls[0] % variants]
        calls[0] += 1
        return paged_attention(
            query, pool.layer(), meta["block_tables"], meta["seq_lens"], meta["query_start_loc"],
            scale=SCALE, max_query_len=max_q, max_seq_len=max_s, num_splits=num_splits,
            config=config, out=out,
        )  # fmt: skip

    return run


def backend_fn(
    pool: Pool, seqs: list[tuple[int, int]], backend: TritonBackend
) -> Callable[[], torch.Tensor]:
    """A whole backend forward (KV write + attention) over ``seqs``."""
    meta = pool.metadata(seqs)
    tables = meta["block_tables"].tolist()
    bs = pool.block_size
    slots = [
        tables[i][p // bs] * bs + p % bs for i, (c, q) in enumerate(seqs) for p in range(c, c + q)
    ]
    query_lens = [q for _, q in seqs]
    attn_meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device="cuda"),
        query_start_loc=meta["query_start_loc"], seq_lens=meta["seq_lens"],
        block_tables=meta["block_tables"], query_lens_host=query_lens,
        seq_lens_host=[c + q for c, q in seqs], max_query_len=max(query_lens),
        max_seq_len=max(c + q for c, q in seqs),
    )  # fmt: skip
    qkv = torch.randn(len(slots), HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    query, key, value = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
    return lambda: backend.forward(query, key, value, pool.layer(), attn_meta, SCALE)


def kv_bytes(tokens: int, fp8: bool | None = None) -> int:
    """Bytes of K and V for ``tokens`` in the cache format (``--kv-cache-dtype`` by default)."""
    fp8 = KV_CACHE_DTYPE[0] != "auto" if fp8 is None else fp8
    row_bytes = HEAD_DIM + SCALE_BYTES if fp8 else HEAD_DIM * DTYPE.itemsize
    return tokens * KV_HEADS * row_bytes * 2


def sdpa_decode_fn(batch: int, ctx: int) -> Callable[[], torch.Tensor]:
    q = torch.randn(batch, HEADS, 1, HEAD_DIM, device="cuda", dtype=DTYPE)
    k = torch.randn(batch, KV_HEADS, ctx, HEAD_DIM, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    return lambda: F.scaled_dot_product_attention(q, k, v, scale=SCALE, enable_gqa=True)


def bench_decode(rows: Rows) -> None:
    print("\n== decode: paged attention, 1 new token per sequence ==", flush=True)
    pool = Pool(64 * 131072 + 64 * 16)
    for batch in (1, 16, 64):
        for ctx in (1024, 4096, 16384, 32768, 65536, 131072):
            seqs = [(ctx - 1, 1)] * batch
            floor = kv_bytes(batch * ctx) / FLOOR_BYTES_PER_S * 1e6
            programs = (batch // (DECODE_CONFIG.block_m // 4) + batch) * KV_HEADS
            splits = choose_num_splits(
                programs, ctx, torch.cuda.get_device_properties(0).multi_processor_count
            )
            t_auto = graph_us(attention_fn(pool, seqs))
            t_one = graph_us(attention_fn(pool, seqs, num_splits=1)) if splits > 1 else t_auto
            t_sdpa = float("nan")
            if kv_bytes(batch * ctx) <= 16 * 2**30:
                t_sdpa = graph_us(sdpa_decode_fn(batch, ctx))
                torch.cuda.empty_cache()
            row: dict[str, object] = {
                "section": "decode", "batch": batch, "ctx": ctx, "splits": splits,
                "triton_us": t_auto, "no_split_us": t_one, "sdpa_contig_us": t_sdpa,
                "floor_us": floor, "floor_frac": floor / t_auto,
                "tb_per_s": kv_bytes(batch * ctx) / t_auto / 1e6,
            }  # fmt: skip
            rows.append(row)
            print(
                f"B={batch:3d} ctx={ctx:6d} splits={splits:2d} triton={t_auto:8.1f}us "
                f"nosplit={t_one:8.1f}us sdpa={t_sdpa:8.1f}us floor={floor:7.1f}us "
                f"({100 * floor / t_auto:4.0f}% of floor, {row['tb_per_s']:.2f} TB/s)",
                flush=True,
            )
    del pool
    torch.cuda.empty_cache()


def bench_decode_tuning(rows: Rows) -> None:
    print("\n== decode tuning: tiles and split counts ==", flush=True)
    pool = Pool(64 * 8192 + 4 * 131072)
    configs = [
        AttentionConfig(16, 32, 4, 3), AttentionConfig(16, 64, 4, 2), AttentionConfig(16, 64, 4, 3),
        AttentionConfig(16, 64, 4, 4), AttentionConfig(16, 128, 4, 2), AttentionConfig(16, 128, 4, 3),
        AttentionConfig(16, 64, 2, 2), AttentionConfig(16, 64, 2, 3), AttentionConfig(16, 128, 8, 3),
    ]  # fmt: skip
    for seqs, splits, label in (
        ([(575, 1)] * 256, 1, "B=256 ctx=576"),  # the throughput benchmark's decodes
        ([(8191, 1)] * 64, 1, "B=64 ctx=8k"),
        ([(32767, 1)], 64, "B=1 ctx=32k split64"),
        ([(131071, 1)] * 4, 16, "B=4 ctx=128k split16"),
    ):
        for config in configs:
            t = graph_us(attention_fn(pool, seqs, num_splits=splits, config=config))
            rows.append({"section": "decode_config", "case": label, "config": str(config), "us": t})
            print(f"{label:22s} {config} {t:8.1f}us", flush=True)
    for batch, ctx in ((1, 4096), (1, 32768), (1, 131072), (4, 131072)):
        seqs = [(ctx - 1, 1)] * batch
        for splits in (1, 4, 8, 16, 32, 64, 128):
            t = graph_us(attention_fn(pool, seqs, num_splits=splits))
            floor = kv_bytes(batch * ctx) / FLOOR_BYTES_PER_S * 1e6
            rows.append(
                {"section": "decode_splits", "batch": batch, "ctx": ctx, "splits": splits, "us": t}
            )
            print(
                f"B={batch} ctx={ctx:6d} splits={splits:3d} {t:8.1f}us floor={floor:6.1f}us",
                flush=True,
            )
    block32 = Pool(64 * 8192, block_size=32)
    for bs, p in ((16, pool), (32, block32)):
        t = graph_us(attention_fn(p, [(8191, 1)] * 64))
        rows.append({"section": "decode_block_size", "block_size": bs, "us": t})
        print(f"B=64 ctx=8k block_size={bs}: {t:8.1f}us", flush=True)
    del pool, block32
    torch.cuda.empty_cache()


def causal_flops(seqs: list[tuple[int, int]]) -> float:
    """Useful attention FLOPs (QK^T and PV) of chunks with cached context, causal."""
    total = 0.0
    for ctx, q in seqs:
        total += q * ctx + q * (q + 1) / 2
    return 4.0 * HEADS * HEAD_DIM * total


def sdpa_prefill_fn(length: int, expand: bool, layout: str) -> Callable[[], torch.Tensor]:
    kv_heads = HEADS if expand else KV_HEADS
    if layout == "contiguous":
        q = torch.randn(1, HEADS, length, HEAD_DIM, device="cuda", dtype=DTYPE)
        k = torch.randn(1, kv_heads, length, HEAD_DIM, device="cuda", dtype=DTYPE)
        v = torch.randn_like(k)
    else:  # [T, heads, D] tensors seen through a transpose, as the backend passes them
        q = torch.randn(length, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE).transpose(0, 1)[None]
        k = torch.randn(length, kv_heads, HEAD_DIM, device="cuda", dtype=DTYPE).transpose(0, 1)[
            None
        ]
        v = torch.randn(length, kv_heads, HEAD_DIM, device="cuda", dtype=DTYPE).transpose(0, 1)[
            None
        ]
    return lambda: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=SCALE, enable_gqa=not expand
    )


def bench_prefill(rows: Rows) -> None:
    print("\n== prefill: whole prompts and chunks over cached context ==", flush=True)
    pool = Pool(2 * 131072)
    for length in (512, 2048, 8192, 16384):
        seqs = [(0, length)]
        flops = causal_flops(seqs)
        t_triton = time_us(attention_fn(pool, seqs))
        t_gqa = time_us(sdpa_prefill_fn(length, expand=False, layout="contiguous"))
        t_exp = time_us(sdpa_prefill_fn(length, expand=True, layout="contiguous"))
        t_view = time_us(sdpa_prefill_fn(length, expand=False, layout="tokens_major"))
        rows.append({
            "section": "prefill", "ctx": 0, "chunk": length, "triton_us": t_triton,
            "sdpa_gqa_us": t_gqa, "sdpa_expanded_us": t_exp, "sdpa_tokens_major_us": t_view,
        })  # fmt: skip
        print(
            f"prompt={length:6d} triton={t_triton:8.1f}us ({flops / t_triton / 1e6:5.0f} TF/s) "
            f"sdpa_gqa={t_gqa:8.1f}us ({flops / t_gqa / 1e6:5.0f} TF/s) "
            f"sdpa_expanded={t_exp:8.1f}us sdpa_backend_layout={t_view:8.1f}us",
            flush=True,
        )
    for ctx, chunk in ((0, 8192), (4096, 512), (16384, 2048), (65536, 2048), (131072 - 8192, 8192)):
        seqs = [(ctx, chunk)]
        flops = causal_flops(seqs)
        t_triton = time_us(backend_fn(pool, seqs, TritonBackend(None, None)))
        t_sdpa = time_us(backend_fn(pool, seqs, TritonBackend(512, 512)))
        rows.append({
            "section": "prefill_backend", "ctx": ctx, "chunk": chunk,
            "all_triton_us": t_triton, "sdpa_us": t_sdpa,
        })  # fmt: skip
        print(
            f"backend ctx={ctx:6d} chunk={chunk:5d} all-triton={t_triton:8.1f}us "
            f"({flops / t_triton / 1e6:5.0f} TF/s) chunk-on-SDPA={t_sdpa:8.1f}us "
            f"({flops / t_sdpa / 1e6:5.0f} TF/s)",
            flush=True,
        )
    configs = [
        AttentionConfig(64, 64, 4, 2), AttentionConfig(64, 64, 4, 1), AttentionConfig(64, 32, 4, 2),
        AttentionConfig(64, 32, 4, 3), AttentionConfig(128, 64, 8, 3), AttentionConfig(128, 64, 4, 2),
        AttentionConfig(128, 128, 8, 3), AttentionConfig(32, 64, 4, 2),
    ]  # fmt: skip
    for seqs in ([(0, 4096)], [(16384, 2048)]):
        flops = causal_flops(seqs)
        for config in configs:
            t = time_us(attention_fn(pool, seqs, config=config))
            rows.append(
                {"section": "prefill_config", "seqs": str(seqs), "config": str(config), "us": t}
            )
            print(f"{seqs!s:16s} {config} {t:8.1f}us ({flops / t / 1e6:5.0f} TF/s)", flush=True)
    del pool
    torch.cuda.empty_cache()


def bench_mixed(rows: Rows) -> None:
    print("\n== mixed batch: one 2k chunk at 8k context + 63 decodes at 8k ==", flush=True)
    pool = Pool(64 * 10240)
    decodes = [(8191, 1)] * 63
    chunk = [(8192, 2048)]
    parts = {
        "mixed, 128-row tiles": time_us(attention_fn(pool, chunk + decodes, config=AttentionConfig(128, 64, 8, 3))),
        "mixed, prefill tiles": time_us(attention_fn(pool, chunk + decodes, config=PREFILL_CONFIG)),
        "mixed, decode tiles": time_us(attention_fn(pool, chunk + decodes, config=DECODE_CONFIG)),
        "decodes alone": time_us(attention_fn(pool, decodes)),
        "chunk alone": time_us(attention_fn(pool, chunk)),
        "backend, all triton": time_us(backend_fn(pool, decodes + chunk, TritonBackend(None, None))),
        "backend, chunk on SDPA": time_us(backend_fn(pool, decodes + chunk, TritonBackend(512, 512))),
    }  # fmt: skip
    for label, t in parts.items():
        rows.append({"section": "mixed", "case": label, "us": t})
        print(f"{label:22s} {t:8.1f}us", flush=True)
    del pool
    torch.cuda.empty_cache()


def bench_kv_write(rows: Rows) -> None:
    print("\n== KV write: new K/V into random slots ==", flush=True)
    pool = Pool(131072)
    for tokens in (64, 8192):
        slots = torch.randperm(pool.num_blocks * pool.block_size, device="cuda")[:tokens]
        key = torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        value = torch.randn_like(key)
        t_triton = graph_us(lambda: write_kv_triton(key, value, pool.layer(), slots))  # noqa: B023
        t_torch = graph_us(lambda: write_kv(key, value, pool.layer(), slots))  # noqa: B023
        rows.append(
            {"section": "kv_write", "tokens": tokens, "triton_us": t_triton, "torch_us": t_torch}
        )
        print(f"tokens={tokens:5d} triton={t_triton:7.1f}us torch={t_torch:7.1f}us", flush=True)


def bench_many_decodes(rows: Rows) -> None:
    """Decode tile shapes by batch size, bf16 and 8-bit caches: where the 8-bit cache's
    shape for large batches (``FP8_MANY_DECODES_CONFIG``) pays."""
    print("\n== decode batches: the default tile shape and the large batches' ==", flush=True)
    pools = {
        "bf16": Pool(256 * 4096 + 256 * 16, fp8=False),
        "fp8": Pool(256 * 4096 + 256 * 16, fp8=True),
    }
    shapes = {
        "bf16": {"default": DECODE_CONFIG, "many": FP8_MANY_DECODES_CONFIG},
        "fp8": {"default": FP8_DECODE_CONFIG, "many": FP8_MANY_DECODES_CONFIG},
    }
    for batch in (64, 128, 256):
        for ctx in (576, 1024, 2048, 4096):
            seqs = [(ctx - 1, 1)] * batch
            line = f"B={batch:3d} ctx={ctx:5d}"
            for name, pool in pools.items():
                times = {
                    label: graph_us(attention_fn(pool, seqs, config=config))
                    for label, config in shapes[name].items()
                }
                rows.append({"section": "many_decodes", "cache": name, "batch": batch,
                             "ctx": ctx, **{f"{k}_us": v for k, v in times.items()}})  # fmt: skip
                line += (
                    f"  {name}: default {times['default']:7.1f}us many {times['many']:7.1f}us"
                    f" ({times['default'] / times['many']:.2f}x)"
                )
            print(line, flush=True)
    del pools
    torch.cuda.empty_cache()


def bench_fp8_kv(rows: Rows) -> None:
    """Decode, chunks over cached context and KV writes over a bf16 and an FP8 cache."""
    print("\n== FP8 KV cache against bf16: decode, prefill over context, KV write ==", flush=True)
    pools = {
        "bf16": Pool(64 * 32768 + 64 * 16, fp8=False),
        "fp8": Pool(64 * 32768 + 64 * 16, fp8=True),
    }
    # NOTE: 256 x 576 is the throughput benchmark's decode half-way through its answers
    # (256 x (512 in, 128 out)): short contexts, many sequences.
    shapes = ((1, 4096), (1, 131072), (4, 131072), (16, 32768), (64, 8192), (64, 32768), (256, 576))
    for batch, ctx in shapes:
        seqs = [(ctx - 1, 1)] * batch
        times = {name: graph_us(attention_fn(pool, seqs)) for name, pool in pools.items()}
        floors = {
            name: kv_bytes(batch * ctx, name == "fp8") / FLOOR_BYTES_PER_S * 1e6 for name in pools
        }
        rows.append({
            "section": "fp8_decode", "batch": batch, "ctx": ctx,
            "bf16_us": times["bf16"], "fp8_us": times["fp8"],
            "bf16_floor_us": floors["bf16"], "fp8_floor_us": floors["fp8"],
        })  # fmt: skip
        print(
            f"decode B={batch:3d} ctx={ctx:6d} bf16={times['bf16']:8.1f}us "
            f"({100 * floors['bf16'] / times['bf16']:3.0f}% of floor) fp8={times['fp8']:8.1f}us "
            f"({100 * floors['fp8'] / times['fp8']:3.0f}% of floor) "
            f"speed-up {times['bf16'] / times['fp8']:.2f}x",
            flush=True,
        )
    for ctx, chunk in ((4096, 512), (16384, 2048), (65536, 2048), (131072 - 8192, 8192)):
        seqs = [(ctx, chunk)]
        flops = causal_flops(seqs)
        t = {
            "bf16 all-triton": time_us(backend_fn(pools["bf16"], seqs, TritonBackend(None, None))),
            "bf16 default": time_us(backend_fn(pools["bf16"], seqs, TritonBackend())),
            "fp8 all-triton": time_us(
                backend_fn(pools["fp8"], seqs, TritonBackend(None, None, None))
            ),
            "fp8 gather+SDPA": time_us(
                backend_fn(pools["fp8"], seqs, TritonBackend(sdpa_min_fp8_chunk_tokens=512))
            ),
        }
        rows.append({"section": "fp8_prefill", "ctx": ctx, "chunk": chunk, **t})
        print(
            f"chunk ctx={ctx:6d} chunk={chunk:5d} "
            + " ".join(f"{k}={v:9.1f}us ({flops / v / 1e6:4.0f} TF/s)" for k, v in t.items()),
            flush=True,
        )
    for tokens in (64, 8192):
        key = torch.randn(tokens, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        value = torch.randn_like(key)
        t = {}
        for name, pool in pools.items():
            slots = torch.randperm(pool.num_blocks * pool.block_size, device="cuda")[:tokens]
            t[name] = graph_us(lambda: write_kv_triton(key, value, pool.layer(), slots))  # noqa: B023
        rows.append(
            {"section": "fp8_kv_write", "tokens": tokens, "bf16_us": t["bf16"], "fp8_us": t["fp8"]}
        )
        print(
            f"kv write tokens={tokens:5d} bf16={t['bf16']:7.1f}us fp8={t['fp8']:7.1f}us", flush=True
        )
    del pools
    torch.cuda.empty_cache()


def bench_block_copy(rows: Rows) -> None:
    print("\n== block copies: 256 Llama-3.1-8B blocks (32 layers, 2 MiB each) ==", flush=True)
    cache = torch.randn(1024, 32, 2, 16, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    host = torch.empty(256, *cache.shape[1:], dtype=DTYPE).pin_memory()
    staging = torch.empty(256, *cache.shape[1:], device="cuda", dtype=DTYPE)
    nbytes = host.numel() * host.element_size()
    runs = list(range(300, 556))
    scattered = torch.randperm(1024)[:256].tolist()

    def staged() -> None:
        gather_blocks(cache, scattered, staging)
        host.copy_(staging, non_blocking=True)

    cases = {
        "gather d2h, one run": lambda: gather_blocks(cache, runs, host),
        "gather d2h, 256 runs": lambda: gather_blocks(cache, scattered, host),
        "gather d2h, via staging": staged,
        "scatter h2d, 256 runs": lambda: scatter_blocks(host, cache, scattered),
        "gather d2d index_select": lambda: gather_blocks(cache, scattered, staging),
    }
    for label, fn in cases.items():
        t = time_us(fn)
        rows.append({"section": "block_copy", "case": label, "us": t, "gb_per_s": nbytes / t / 1e3})
        print(f"{label:26s} {t:9.1f}us {nbytes / t / 1e3:7.1f} GB/s", flush=True)


def copy_bandwidth() -> float:
    """Device-to-device copy rate, bytes read plus written per second."""
    src = torch.randn(2**30, device="cuda", dtype=DTYPE)
    dst = torch.empty_like(src)
    t = time_us(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (t * 1e-6)


SECTIONS: dict[str, Callable[[Rows], None]] = {
    "decode": bench_decode,
    "decode_tuning": bench_decode_tuning,
    "prefill": bench_prefill,
    "mixed": bench_mixed,
    "kv_write": bench_kv_write,
    "block_copy": bench_block_copy,
    "fp8_kv": bench_fp8_kv,
    "many_decodes": bench_many_decodes,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    parser.add_argument("--json", default=None, help="write all rows to this file")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8", "int8"],
        default="auto",
        help="the paged cache of the other sections: bf16 (auto), or FP8 or INT8 rows",
    )
    args = parser.parse_args()
    KV_CACHE_DTYPE[0] = args.kv_cache_dtype
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA device")
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}", flush=True)
    print(f"device copy: {copy_bandwidth() / 1e12:.2f} TB/s (read + write)", flush=True)
    rows: Rows = []
    for name in args.sections.split(","):
        try:
            SECTIONS[name](rows)
        except Exception:  # NOTE: one failing section must not lose the others' numbers
            traceback.print_exc()
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
