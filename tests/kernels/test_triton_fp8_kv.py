"""The Triton KV write and paged attention over an 8-bit cache (``kernels/fp8_kv.py``: e4m3
codes in ``uint8``, int8 codes in ``int8``; the shared behaviour is tested for both).

The write must store the bytes ``quantize_slots`` stores; attention must match the
reference backend reading the same 8-bit cache (both attend over the same dequantized
values, so the tolerance is the plain path's). Without CUDA the kernels run under
``TRITON_INTERPRET=1`` on small shapes; on a GPU the same tests take larger shapes, in
float32 and bf16, plus a CUDA graph capture.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from kernels.fp8_kv import FP8_DTYPE, FP8_MAX, dequantize_slots, quantize_slots
from kernels.interface import write_kv
from kernels.reference import ReferenceBackend
from kernels.registry import QUANTIZED_KV_BACKENDS, choose_backend_name
from kernels.triton_attention import (
    DECODE_CONFIG,
    FP8_DECODE_CONFIG,
    FP8_MANY_DECODES_CONFIG,
    FP8_MANY_DECODES_PROGRAMS_PER_SM,
    FP8_PREFILL_CONFIG,
    default_config,
    paged_attention,
)
from kernels.triton_backend import TritonBackend
from kernels.triton_kv_write import (
    _e4m3_codes,
    _int8_codes,
    gather_fp8_context,
    widen_codes,
    write_kv_triton,
)
from tests.kernels.test_triton_kernels import (  # the interpreter fix comes with it
    CASES,
    CUDA,
    DEVICE,
    LAYER,
    Batch,
    rel_error,
)

# The two 8-bit formats, by the cache's storage dtype: e4m3 codes in uint8, int8 codes.
FORMATS = pytest.mark.parametrize("storage", [torch.uint8, torch.int8], ids=["fp8", "int8"])


def fp8_batch(
    seqs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    storage: torch.dtype = torch.uint8,
) -> Batch:
    """A ``Batch`` whose cache is the 8-bit rows (of ``storage``) of its random values."""
    batch = Batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype=dtype, seed=seed)
    batch.cache = quantize_slots(batch.cache, storage)
    return batch


def reference_fp8(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (float32) and cache of the reference backend over a copy of the FP8 cache."""
    cache = batch.cache.clone()
    out = ReferenceBackend().forward(
        batch.query.float(),
        batch.key.float(),
        batch.value.float(),
        cache[:, LAYER],
        batch.meta,
        batch.scale,
    )
    return out, cache


def all_triton_forward(batch: Batch) -> torch.Tensor:
    """The Triton backend's output with every chunk in the paged kernel (no SDPA)."""
    return TritonBackend(None, None, None).forward(
        batch.query, batch.key, batch.value, batch.layer(), batch.meta, batch.scale
    )


@triton.jit
def _codes_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, _e4m3_codes(x).to(tl.uint8), mask=offs < n)


@triton.jit
def _int8_codes_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, _int8_codes(x), mask=offs < n)


def test_int8_rounding_matches_torch_on_every_half_and_its_neighbours() -> None:
    """Every integer and half in [-130, 130] (ties to even), the floats just either side of
    each, fractions, signed zeros, denormals and values past +-127 (clamped, never -128)
    round as ``torch.round(...).clamp(-127, 127)``."""
    halves = torch.arange(-260, 261, dtype=torch.float32) / 2
    around = torch.cat([halves.nextafter(halves - 1), halves.nextafter(halves + 1)])
    odd = torch.tensor([0.0, -0.0, 1e-45, -1e-40, 0.3, -0.7, 126.9, -127.4, 1e9, -3e38])
    fractions = torch.randn(2048, generator=torch.Generator().manual_seed(0)) * 60
    x = torch.cat([halves, around, odd, fractions]).to(DEVICE)
    codes = torch.empty(x.shape, dtype=torch.int8, device=DEVICE)
    _int8_codes_kernel[(triton.cdiv(x.numel(), 1024),)](x, codes, x.numel(), BLOCK=1024)
    expected = x.round().clamp(-127, 127).to(torch.int8)
    assert torch.equal(codes, expected), x[codes != expected]
    assert int(codes.min()) == -127


@triton.jit
def _widen_kernel(codes_ptr, out_ptr, INT8: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, widen_codes(tl.load(codes_ptr + offs), out_ptr.dtype.element_ty, INT8))


@FORMATS
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_every_code_widens_exactly(storage: torch.dtype, dtype: torch.dtype) -> None:
    """All 256 codes of each format, as the attention kernels widen them (int8 to fp16 by
    bits), equal torch's conversion of the same codes."""
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(storage).to(DEVICE)
    out = torch.empty(256, dtype=dtype, device=DEVICE)
    _widen_kernel[(1,)](codes, out, INT8=storage == torch.int8)
    reference = codes.view(FP8_DTYPE) if storage == torch.uint8 else codes
    expected = reference.float().to(dtype)
    finite = ~expected.isnan()
    assert torch.equal(out[finite], expected[finite])


def test_e4m3_rounding_matches_torch_on_every_value_and_tie() -> None:
    """Every e4m3 value, the midpoints between neighbours (ties to even), values just
    either side of them, subnormals and the float32 denormals all round as torch does."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    finite = values[~values.isnan() & (values >= 0)].sort().values
    mids = (finite[1:] + finite[:-1]) / 2
    around = torch.cat([mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9))])
    tiny = torch.tensor([1e-45, 1e-40, 2.0**-10, 2.0**-10 * 1.0001, 2.0**-126, 3 * 2.0**-11])
    x = torch.cat([finite, around, tiny, torch.tensor([0.0, FP8_MAX])])
    x = torch.cat([x, -x]).clamp(-FP8_MAX, FP8_MAX).to(DEVICE)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=DEVICE)
    _codes_kernel[(triton.cdiv(x.numel(), 1024),)](x, codes, x.numel(), BLOCK=1024)
    expected = x.to(FP8_DTYPE).view(torch.uint8)
    assert torch.equal(codes, expected), x[codes != expected]


@FORMATS
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(3, 32, 4), (1, 128, 16), (2, 20, 8)])
def test_write_kernel_is_bit_identical_to_the_torch_quantizer(
    num_kv_heads: int, head_dim: int, block_size: int, storage: torch.dtype
) -> None:
    """Rows of magnitudes 1e-30..1e30, outliers, zero, denormal and negative-zero rows,
    into a non-contiguous layer view; negative slots are skipped."""
    gen = torch.Generator().manual_seed(head_dim)
    num_tokens, num_blocks = 24, 20
    x = torch.randn(num_tokens, 2 * num_kv_heads, head_dim, generator=gen)
    x *= torch.pow(10.0, torch.randint(-30, 31, (num_tokens, 2 * num_kv_heads, 1), generator=gen))
    x[0] = 0.0
    x[1, 0] = 1e-41
    x[2, -1] = -0.0
    x[3, :, ::5] *= 60.0
    # Exact ties under int8's scale (amax 31.75: scale 1/4): -1.5 -> -2, 2.5 -> 2. (int8
    # rotates rows first, which moves the ties: its rounding has its own test above.)
    x[4] = x[4].clamp(-1.0, 1.0)
    x[4, :, :3] = torch.tensor([31.75, -0.375, 0.625])
    cache = torch.randint(0, 256, (num_blocks, 2, 2, block_size, num_kv_heads, head_dim + 4),
                          dtype=torch.uint8, generator=gen).view(storage)  # fmt: skip
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[5] = -1
    expected = cache.clone()
    key, value = x[:, :num_kv_heads], x[:, num_kv_heads:]
    kept = slots >= 0
    write_kv(key[kept], value[kept], expected[:, 1], slots[kept])
    cache = cache.to(DEVICE)
    write_kv_triton(key.to(DEVICE), value.to(DEVICE), cache[:, 1], slots.to(DEVICE))
    assert torch.equal(cache.cpu(), expected)


@FORMATS
@pytest.mark.parametrize("case", range(len(CASES)))
def test_backend_over_8bit_matches_reference_over_8bit(case: int, storage: torch.dtype) -> None:
    """Decodes, mixed batches and chunks over context, several GQA ratios and block sizes."""
    seqs, heads, kv_heads, head_dim, block_size = CASES[case]
    batch = fp8_batch(seqs, heads, kv_heads, head_dim, block_size, seed=case, storage=storage)
    ref_out, ref_cache = reference_fp8(batch)
    out = all_triton_forward(batch)
    assert torch.equal(batch.cache, ref_cache), "8-bit KV write differs from the reference"
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)


@FORMATS
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("head_dim", [32, 24])
def test_split_k_over_8bit_matches_reference(
    num_splits: int, head_dim: int, storage: torch.dtype
) -> None:
    """head_dim 24: int8's rotation takes blocks of 8 in a 32-wide padded tile, rotated
    back in the kernel (one split) or at the merge (three)."""
    seqs = [(300, 1), (70, 1), (1, 1), (120, 13)] if CUDA else [(45, 1), (1, 1), (30, 5)]
    batch = fp8_batch(seqs, 6, 2, head_dim, 16, seed=num_splits, storage=storage)
    ref_out, _ = reference_fp8(batch)
    write_kv_triton(batch.key, batch.value, batch.layer(), batch.meta.slot_mapping)
    out = paged_attention(
        batch.query, batch.layer(), batch.meta.block_tables, batch.meta.seq_lens,
        batch.meta.query_start_loc, scale=batch.scale, max_query_len=batch.meta.max_query_len,
        max_seq_len=batch.meta.max_seq_len, num_splits=num_splits,
    )  # fmt: skip
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fp8_chunk_limit", [None, 8])
@pytest.mark.parametrize(
    "seqs",
    [
        [(20, 1), (5, 3), (30, 12), (0, 10)],  # Triton prefix, then a chunk over context + a prompt
        [(0, 37)],  # one whole prompt: SDPA over its FP8 round-tripped K/V
    ],
)
@FORMATS
def test_long_chunk_routing_over_8bit_matches_reference(
    seqs: list[tuple[int, int]], fp8_chunk_limit: int | None, storage: torch.dtype
) -> None:
    """A chunk over 8-bit context stays in Triton (None) or goes to SDPA over its gathered,
    dequantized context (8)."""
    batch = fp8_batch(seqs, 8, 2, 64, 16, seed=len(seqs), storage=storage)
    ref_out, ref_cache = reference_fp8(batch)
    backend = TritonBackend(
        sdpa_min_tokens=8, sdpa_min_chunk_tokens=8, sdpa_min_fp8_chunk_tokens=fp8_chunk_limit
    )
    out = backend.forward(
        batch.query, batch.key, batch.value, batch.layer(), batch.meta, batch.scale
    )
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    assert torch.equal(batch.cache, ref_cache)


@FORMATS
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gather_fp8_context_equals_dequantized_rows(
    dtype: torch.dtype, storage: torch.dtype
) -> None:
    batch = fp8_batch([(37, 1)], 4, 2, 32, 16, seed=3, storage=storage)
    table = batch.meta.block_tables[0]
    key, value = gather_fp8_context(batch.layer(), table, 37, dtype)
    blocks = table[:3].long()
    for kind, got in ((0, key), (1, value)):
        rows = batch.layer()[blocks, kind].reshape(-1, 2, 36)[:37]
        assert got.dtype == dtype and got.is_contiguous()
        assert torch.equal(got, dequantize_slots(rows, dtype))


@pytest.mark.parametrize(
    "dtype",
    [
        # NOTE: only on a GPU: the triton 3.6 interpreter dots bf16 bits as ints.
        pytest.param(torch.bfloat16, marks=pytest.mark.gpu),
        torch.float16,
    ],
)
@pytest.mark.parametrize("case", [0, 1, len(CASES) - 1] if not CUDA else range(len(CASES)))
@FORMATS
def test_half_precision_over_8bit_close_to_fp32_reference(
    dtype: torch.dtype, case: int, storage: torch.dtype
) -> None:
    """Tensor-core tile shapes: codes converted to fp16, scales outside the dots."""
    seqs, heads, kv_heads, head_dim, block_size = CASES[case]
    batch = fp8_batch(
        seqs, heads, kv_heads, head_dim, block_size, dtype=dtype, seed=7 + case, storage=storage
    )
    ref_out, _ = reference_fp8(batch)
    out = all_triton_forward(batch)
    assert out.dtype == dtype and not out.isnan().any()
    assert rel_error(out, ref_out) < 1e-2


@FORMATS
@pytest.mark.parametrize("magnitude", [1e-4, 1e4, None], ids=["tiny", "huge", "mixed"])
def test_half_precision_over_8bit_keeps_values_of_any_magnitude(
    magnitude: float | None, storage: torch.dtype
) -> None:
    """Values far from 1 (scales below fp16's normal range, or dequantized rows near its
    top) lose no precision in the fp16 dots; ``None``: each token's own magnitude."""
    seqs = [(300, 1), (150, 1), (40, 3)]
    batch = Batch(seqs, 4, 2, 64, 16, dtype=torch.float16, seed=11)
    gen = torch.Generator().manual_seed(11)
    tokens = batch.cache.shape[0] * batch.cache.shape[3]
    if magnitude is None:  # 1e-4 to 1e4, token by token
        factors = 10.0 ** (torch.rand(tokens, generator=gen) * 8 - 4)
    else:
        factors = torch.full((tokens,), magnitude)
    factors = factors.view(batch.cache.shape[0], 1, batch.cache.shape[3], 1, 1).to(DEVICE)
    values = batch.cache[:, :, 1].float() * factors
    batch.cache[:, :, 1] = values.clamp(-6e4, 6e4).to(batch.cache.dtype)
    batch.value.mul_(magnitude or 1.0)
    batch.cache = quantize_slots(batch.cache, storage)
    ref_out, _ = reference_fp8(batch)
    out = all_triton_forward(batch)
    assert out.isfinite().all()
    assert rel_error(out, ref_out) < 3e-3  # 1e-3 at most, measured


@pytest.mark.gpu  # cuDNN/flash through SDPA
@FORMATS
@pytest.mark.parametrize("fp8_chunk_limit", [None, 2048])
def test_8bit_bf16_default_routing(fp8_chunk_limit: int | None, storage: torch.dtype) -> None:
    seqs = [(3000, 1), (9000, 1), (700, 100), (12000, 2100), (0, 4000)]
    batch = fp8_batch(seqs, 32, 8, 128, 16, dtype=torch.bfloat16, seed=42, storage=storage)
    ref_out, ref_cache = reference_fp8(batch)
    out = TritonBackend(sdpa_min_fp8_chunk_tokens=fp8_chunk_limit).forward(
        batch.query, batch.key, batch.value, batch.layer(), batch.meta, batch.scale
    )
    assert torch.equal(batch.cache, ref_cache)
    assert not out.isnan().any()
    assert rel_error(out, ref_out) < 1e-2


@pytest.mark.gpu
@FORMATS
def test_8bit_decode_under_a_cuda_graph_replays_new_inputs(storage: torch.dtype) -> None:
    """Capture write + attention once (no host sync inside), replay for other inputs."""
    seqs = [(1000, 1), (37, 1), (4000, 1), (250, 1)]
    batch = fp8_batch(seqs, 32, 8, 128, 16, dtype=torch.bfloat16, seed=5, storage=storage)
    backend = TritonBackend()
    query, key, value = (t.clone() for t in (batch.query, batch.key, batch.value))
    layer = batch.layer()
    backend.forward(query, key, value, layer, batch.meta, batch.scale)  # compile outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(query, key, value, layer, batch.meta, batch.scale)
    # New inputs in the captured buffers, same slots and block tables.
    fresh = torch.randn(batch.cache.shape[:-1] + (128,), device=DEVICE)
    batch.cache.copy_(quantize_slots(fresh, storage))
    for buffer in (query, key, value):
        buffer.copy_(torch.randn_like(buffer))
    batch.query, batch.key, batch.value = query, key, value
    ref_out, ref_cache = reference_fp8(batch)
    graph.replay()
    assert torch.equal(batch.cache, ref_cache)
    assert rel_error(out, ref_out) < 1e-2


def test_8bit_backend_selection() -> None:
    """An 8-bit cache (fp8 or int8) on CUDA: Triton; on the CPU: the reference (the native
    kernels read plain caches)."""
    choose = choose_backend_name
    assert choose(None, "cuda", ["triton", "reference"], quantized_kv=True) == "triton"
    assert choose(None, "cuda", ["reference"], quantized_kv=True) == "reference"
    assert choose(None, "cpu", ["cpu", "reference"], quantized_kv=True) == "reference"
    assert choose(None, "cpu", ["cpu", "reference"]) == "cpu"
    assert choose("cpu", "cpu", ["cpu", "reference"], quantized_kv=True) == "cpu"
    assert set(QUANTIZED_KV_BACKENDS) == {"triton", "reference"}
    for storage in (torch.uint8, torch.int8):
        TritonBackend().check_kv_cache(torch.zeros((2, 1, 2, 4, 1, 20), dtype=storage))


def test_large_8bit_decode_batches_take_their_own_tile_shape() -> None:
    """Many programs per multiprocessor: two warps on 64-token tiles; bf16 keeps its own."""
    group, dtype = 4, torch.bfloat16
    many = FP8_MANY_DECODES_PROGRAMS_PER_SM
    assert default_config(1, group, dtype, True, many) == FP8_MANY_DECODES_CONFIG
    assert default_config(1, group, dtype, True, many - 1) == FP8_DECODE_CONFIG
    assert default_config(1, group, dtype, False, many) == DECODE_CONFIG
    assert default_config(64, group, dtype, True, many) == FP8_PREFILL_CONFIG


@FORMATS
def test_8bit_decodes_of_a_group_wider_than_a_tile(storage: torch.dtype) -> None:
    """32 query heads on one KV head: more rows than a decode tile's 16."""
    batch = fp8_batch([(20, 1), (7, 1)], 32, 1, 16, 16, dtype=torch.float16, storage=storage)
    ref_out, _ = reference_fp8(batch)
    out = all_triton_forward(batch)
    assert rel_error(out, ref_out) < 3e-3
