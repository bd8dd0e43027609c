"""Linear layers on the CPU: bfloat16 weights paired for AVX-512 BF16 or else prepacked once
into oneDNN's blocked layout, float32 weights laid out transposed, and products through
native kernels: float32 up to 64 rows (``csrc/cpu_small_linear.c``); bf16 over a copy of the
weight laid out in pairs for AVX-512 BF16 where the CPU has no AMX (``csrc/cpu_pairs_linear.c``,
any row count), else one or two rows streamed (``csrc/cpu_small_linear.c``) and up to 32 on
AMX tiles (``csrc/cpu_amx_linear.c``).

A decode step multiplies one token by every weight matrix, so it streams all the weights
from memory once per step. ``F.linear`` on a plain bf16 weight reads them at ~14 GB/s on a
2-core AVX-512 BF16 EPYC; the same product over a prepacked weight read at ~18 GB/s (30
SmolLM2-135M layers: 15.4 -> 11.5 ms; its 49152 x 576 LM head: 3.7 -> 2.5 ms). Prefill
chunks gain too: ``F.linear`` reorders the plain weight into the blocked layout at every
call, the packed copy is in it already. Results are bit-identical to ``F.linear`` at every
row count measured (see ``_PACK_BATCH_HINT``).

float32 weights keep their values and shape but are stored transposed
(:func:`store_transposed`: ``weight.t()`` contiguous): the native products of a few rows
read a panel of outputs' weights as contiguous runs, and MKL multiplies prefill chunks over
that layout as fast or faster, bit-identically to the plain layout (see
:func:`kept_transposed`'s note).

Where the weight is paired, products of many rows (prefill chunks) run over the pairs too
(:func:`pairs_linear`), and the MLP's gate/up product takes SiLU in the same pass
(:func:`pairs_silu_mul`): on a 2-core AVX-512 BF16 EPYC, SmolLM2's four projections with
SiLU took 0.90-0.97x the time of oneDNN's products over the packed weight and a separate
SiLU pass at 256 to 4,096 rows (``python -m kernels.bench_cpu_linear``), and a weight that
is paired needs no packed copy.

Where the CPU has no AMX and float32 products run faster than its bf16 ones (timed once per
process, :func:`float32_products_faster`), bf16 products of many rows (prefill chunks) run
in float32 over a float32 copy of the weight (:func:`wide_linear`): on a Xeon with
AVX-512 BF16 and no AMX, oneDNN's bf16 path ran at about 0.6x its float32 rate.

A packed, paired or widened weight is a copy: it costs the weight's size again (twice,
widened) in memory and goes stale when the plain weight changes, so whoever writes weights
packs again afterwards."""

from __future__ import annotations

import functools
import logging
import math
import os
import time

import torch
import torch.nn.functional as F

from kernels import cpu_native

logger = logging.getLogger(__name__)

# NOTE: oneDNN picks the blocked layout for a batch size. A prefill chunk's is the one that
# F.linear reorders the plain weight into at every call, so products over it are
# bit-identical to F.linear's whatever the rows (a decode-shaped layout, batch size 1, gave
# other roundings from 33 rows on). On 2 AMX cores it ran SmolLM2's projections at least as
# fast as the plain weight or the decode-shaped layout at 64 to 2,048 rows (30 layers at
# 2,048 rows: 185-187 against 189-192 and 206-208 ms, interleaved; 0.75-0.8x the
# decode-shaped layout's time at 256-1,024); with oneDNN held to AVX-512 BF16
# (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``), as fast as the decode-shaped one at 1 to 32 rows.
_PACK_BATCH_HINT = 2048


def can_pack(weight: torch.Tensor) -> bool:
    """True for a bf16 CPU weight on a build whose oneDNN runs bf16 natively (AVX-512 BF16 / AMX).

    float32 is deliberately excluded: it is the dtype checked token for token against
    transformers, and keeps the exact ``F.linear`` path.
    """
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """An opaque oneDNN copy of ``weight [out, in]`` for :func:`packed_linear`."""
    if not can_pack(weight):
        raise ValueError(
            f"cannot prepack a {weight.dtype} weight of shape {tuple(weight.shape)} on "
            f"{weight.device}: only 2-D bfloat16 CPU weights with oneDNN bf16 support"
        )
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x [..., in]`` in bf16, ``packed`` from :func:`pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# NOTE: measured on a 2-core Xeon with AVX-512 BF16 and no AMX, all four projections of
# SmolLM2's 30 layers: at 2,048 rows 3.15 s over the packed bf16 weight against 1.97 s as
# float32 products of a float32 copy (the rows widened, the result rounded once to bf16);
# 0.40 against 0.25 s at 256 rows, 109 against 102 ms at 64. At 32 rows and fewer the
# packed bf16 weight is as fast or faster (56 against 69 ms at 32, 16 against 26 at 3):
# those products are bound by reading the weights, and the copy is twice the bytes.
WIDE_MIN_ROWS = 33
# NOTE: a model keeps float32 copies only while they take at most this much memory (a 0.5B
# model's projections); larger models keep their long bf16 products in bf16.
WIDE_MAX_BYTES = 2 * 2**30
# NOTE: and paired copies (pair_weight) while they take at most this much (a 1B model's);
# larger models multiply their few-row bf16 products on oneDNN.
PAIRS_MAX_BYTES = 2 * 2**30


ENV_WIDE = "RAGSERVE_CPU_BF16_WIDE"


@functools.cache
def float32_products_faster() -> bool:
    """Whether a bf16 prefill-sized product (256 rows through a SmolLM2 MLP projection) runs
    faster as :func:`wide_linear` than in bf16 here (over the paired weight where the CPU
    pairs, :func:`pairs_apply`, else the packed one), best of 5 each,
    interleaved (about 50 ms, once per process). ``RAGSERVE_CPU_BF16_WIDE=1`` or ``0``
    decides instead."""
    forced = os.environ.get(ENV_WIDE, "")
    if forced:
        return forced != "0"
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 576, generator=generator).bfloat16()
    weight = torch.randn(1536, 576, generator=generator).bfloat16()
    paired = pair_weight(weight) if pairs_apply(weight) else None
    packed = pack_weight(weight) if paired is None and can_pack(weight) else None
    wide = widen_weight(weight)

    def bf16() -> torch.Tensor:
        if paired is not None:
            return pairs_linear(x, paired, None, weight.shape[0])
        return F.linear(x, weight) if packed is None else packed_linear(x, packed, None)

    best = {"bf16": math.inf, "float32": math.inf}
    for _ in range(6):  # NOTE: the first round warms both up and counts too
        for name, product in (("bf16", bf16), ("float32", lambda: wide_linear(x, wide, None))):
            started = time.perf_counter()
            product()
            best[name] = min(best[name], time.perf_counter() - started)
    faster = best["float32"] < best["bf16"]
    logger.info(
        "bf16 products of %d+ rows run %s (256 rows: bf16 %.2f ms, float32 %.2f ms)",
        WIDE_MIN_ROWS, "in float32" if faster else "in bf16", best["bf16"] * 1e3,
        best["float32"] * 1e3,
    )  # fmt: skip
    return faster


def widens(weight: torch.Tensor) -> bool:
    """True for a 2-D bf16 CPU weight where the CPU has no AMX and float32 products are the
    faster (:func:`float32_products_faster`): its products of ``WIDE_MIN_ROWS`` rows or more
    run in float32 (:func:`wide_linear`)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and not cpu_native.amx()
        and float32_products_faster()
    )


def widen_weight(weight: torch.Tensor) -> torch.Tensor:
    """The float32 copy of ``weight`` that :func:`wide_linear` multiplies by (exact)."""
    return weight.detach().float()


def wide_linear(x: torch.Tensor, wide: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for bf16 ``x [..., in]``, summed in float32 over ``wide`` (from
    :func:`widen_weight`) and rounded once to bf16."""
    out = F.linear(x.float(), wide, None if bias is None else bias.float())
    return out.to(x.dtype)


# NOTE: as csrc/cpu_small_linear.c's SMALL_LINEAR_MAX_ROWS. From about this many rows on,
# MKL's blocked GEMM (prefill chunks) is as fast.
SMALL_LINEAR_MAX_ROWS = 64


# NOTE: on 2 AVX-512 cores (a Xeon without AMX), MKL's products over the transposed float32
# weight were bit-identical to the plain weight's at 64 to 2,048 rows of SmolLM2's shapes,
# and as fast or faster (2,048 rows: 254-322 against 209-305 GFLOP/s; 64 rows: 202-219
# against 178-193).
def kept_transposed(weight: torch.Tensor) -> bool:
    """True for a 2-D float32 CPU weight: it is stored transposed (:func:`store_transposed`)."""
    return weight.dim() == 2 and _transposes(weight.device, weight.dtype)


def _transposes(device: torch.device | str, dtype: torch.dtype) -> bool:
    return torch.device(device).type == "cpu" and dtype == torch.float32


def empty_weight(
    out_features: int, in_features: int, *, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """An uninitialised ``[out_features, in_features]`` weight, stored transposed where
    :func:`kept_transposed` (so that loading writes it in place in that layout)."""
    if _transposes(device, dtype):
        return torch.empty(in_features, out_features, device=device, dtype=dtype).t()
    return torch.empty(out_features, in_features, device=device, dtype=dtype)


def store_transposed(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` with the same values, stored transposed: ``result.t()`` is
    contiguous, as :func:`small_linear` reads float32 weights."""
    return weight.t().contiguous().t()


# NOTE: as csrc/cpu_small_linear.c's BF16_SMALL_LINEAR_MAX_ROWS: one or two bf16 rows
# (decode steps of one or two sequences) stream the plain weight with vdpbf16ps where it has
# no paired copy. Over the paired copy they take 0.69-0.70x the time (SmolLM2's 30 layers
# from memory, 24-26 against 17 GB/s, a 2-core AVX-512 BF16 EPYC, kernels.bench_cpu_linear):
# one sequential stream a thread instead of eight short ones.
BF16_SMALL_LINEAR_MAX_ROWS = 2
# NOTE: up to this many bf16 rows (decode steps of many sequences, questions) multiply
# natively: on AMX tiles (csrc/cpu_amx_linear.c) where the CPU has them, else over the weight
# laid out in pairs (csrc/cpu_pairs_linear.c, :func:`pair_weight`); more go to oneDNN.
AMX_LINEAR_MAX_ROWS = 32
PAIRS_LINEAR_MAX_ROWS = 32  # as csrc/cpu_kernels.h
PAIR_PANEL = 48  # outputs per panel of a paired weight, as csrc/cpu_kernels.h


def max_rows(dtype: torch.dtype) -> int:
    """The most rows of ``dtype`` that :func:`small_linear` multiplies natively here (float32
    outer-product tiles; bf16 AMX tiles, or ``vdpbf16ps`` over paired weights); 0 without
    them."""
    if dtype == torch.float32:
        return SMALL_LINEAR_MAX_ROWS if cpu_native.vector_width() is not None else 0
    if dtype != torch.bfloat16 or not cpu_native.bf16_dot():
        return 0
    return AMX_LINEAR_MAX_ROWS if cpu_native.amx() else PAIRS_LINEAR_MAX_ROWS


def pairs_apply(weight: torch.Tensor) -> bool:
    """True for a 2-D bf16 CPU weight whose products run over a paired copy
    (:func:`pair_weight`): AVX-512 BF16 builds without AMX, ``in`` a multiple of 32."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.shape[1] % 32 == 0
        and cpu_native.bf16_dot()
        and not cpu_native.amx()
    )


def pair_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` (bf16) laid out for csrc/cpu_pairs_linear.c: int32
    ``[panels, in / 2, PAIR_PANEL]``, element ``[p, i, j]`` holding the bf16 pair
    ``weight[p * PAIR_PANEL + j, 2i : 2i + 2]`` (low half first), zero past ``out``."""
    if not pairs_apply(weight):
        raise ValueError(f"cannot pair a {weight.dtype} weight of shape {tuple(weight.shape)}")
    n_out, k_in = weight.shape
    panels = -(-n_out // PAIR_PANEL)
    padded = torch.zeros(panels * PAIR_PANEL, k_in, dtype=weight.dtype)
    padded[:n_out] = weight.detach()
    pairs = padded.view(torch.int32).view(panels, PAIR_PANEL, k_in // 2)
    return pairs.transpose(1, 2).contiguous()


def small_linear_usable(
    x: torch.Tensor, weight: torch.Tensor, pairs: torch.Tensor | None = None
) -> bool:
    """True for contiguous CPU rows ``x [rows, in]`` and a CPU ``weight [out, in]`` of their
    dtype, with the native kernels built: float32 up to SMALL_LINEAR_MAX_ROWS rows over a
    weight stored transposed (:func:`store_transposed`); bf16 on AVX-512 BF16 builds (``in``
    a multiple of 32, the weight contiguous), up to BF16_SMALL_LINEAR_MAX_ROWS rows, or
    AMX_LINEAR_MAX_ROWS where AMX runs, or PAIRS_LINEAR_MAX_ROWS given the weight's
    ``pairs`` (:func:`pair_weight`)."""
    if not (
        x.dim() == 2
        and weight.dim() == 2
        and multiplies_natively(x.shape[0], x.dtype, pairs is not None)
        and x.dtype == weight.dtype
        and x.device.type == weight.device.type == "cpu"
        and x.is_contiguous()
    ):
        return False
    if x.dtype == torch.bfloat16:
        return weight.is_contiguous() and x.shape[1] % 32 == 0
    return weight.t().is_contiguous()


def multiplies_natively(rows: int, dtype: torch.dtype, paired: bool) -> bool:
    """Whether :func:`small_linear` takes ``rows`` rows of ``dtype`` here, over weights with
    (``paired``) or without their paired copies."""
    if not 0 < rows <= max_rows(dtype):
        return False
    return (
        dtype != torch.bfloat16 or rows <= BF16_SMALL_LINEAR_MAX_ROWS or cpu_native.amx() or paired
    )


def pairs_linear(
    x: torch.Tensor, pairs: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``x @ weight.T + bias`` for bf16 rows ``x [..., in]`` of any count, over the weight's
    paired copy (:func:`pair_weight`) of ``out_features`` outputs: decode steps split by
    panels, longer products (prefill chunks) by rows (``csrc/cpu_pairs_linear.c``). A row's
    result is the same bits whatever the other rows are."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty((rows.shape[0], out_features), dtype=torch.bfloat16)
    _call_paired("ragserve_pairs_linear_bf16", rows, out_features, pairs, bias, out)
    return out.reshape(*x.shape[:-1], out_features)


def pairs_silu_mul(
    x: torch.Tensor, pairs: torch.Tensor, bias: torch.Tensor | None, intermediate_size: int
) -> torch.Tensor:
    """``silu(gate) * up`` of ``[gate | up] = x @ weight.T + bias`` for bf16 rows ``x [rows,
    in]``, ``pairs`` the paired ``[2 * intermediate_size, in]`` gate/up weight: one pass
    with the same bits as :func:`pairs_linear` and a separate SiLU pass, the product never
    stored (``csrc/cpu_pairs_linear.c``). ``intermediate_size`` must be whole panels
    (:func:`fuses_silu_mul`)."""
    if intermediate_size % PAIR_PANEL or pairs.shape[0] * PAIR_PANEL != 2 * intermediate_size:
        raise ValueError(
            f"no fused SiLU over {pairs.shape[0]} panels for {intermediate_size} intermediates"
        )
    rows = x.contiguous()
    out = torch.empty((rows.shape[0], intermediate_size), dtype=torch.bfloat16)
    _call_paired("ragserve_pairs_silu_mul_bf16", rows, intermediate_size, pairs, bias, out)
    return out


def fuses_silu_mul(intermediate_size: int) -> bool:
    """Whether :func:`pairs_silu_mul` takes an MLP of ``intermediate_size``: whole panels, so
    that no panel holds both gate and up outputs."""
    return intermediate_size % PAIR_PANEL == 0


def _call_paired(
    name: str,
    rows: torch.Tensor,
    n_out: int,
    pairs: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    library = cpu_native.load()
    assert library is not None
    status = getattr(library, name)(
        rows.shape[0],
        n_out,
        rows.shape[1],
        rows.data_ptr(),
        pairs.data_ptr(),
        None if bias is None else bias.contiguous().data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    assert status == 0, (name, status)


def small_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pairs: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for inputs :func:`small_linear_usable` accepts, in their dtype:
    float32 at ``F.linear``'s rate or up to 1.2x it at decode batches, each row's result the
    same whatever the other rows are; bf16 summed in float32 and rounded once (see the C
    files)."""
    library = cpu_native.load()
    assert library is not None
    rows, k_in = x.shape
    n_out = weight.shape[0]
    if x.dtype != torch.bfloat16:
        kernel = library.ragserve_small_linear
    elif pairs is None and rows <= BF16_SMALL_LINEAR_MAX_ROWS:
        kernel = library.ragserve_small_linear_bf16
    elif pairs is None and cpu_native.amx():
        kernel = library.ragserve_amx_linear_bf16
    else:
        expected = (-(-n_out // PAIR_PANEL), k_in // 2, PAIR_PANEL)
        if pairs is None or pairs.dtype != torch.int32 or tuple(pairs.shape) != expected:
            raise ValueError(f"{rows} bf16 rows need the weight's paired copy {expected}")
        return pairs_linear(x, pairs.contiguous(), bias, n_out)
    out = torch.empty((rows, n_out), dtype=x.dtype)
    status = kernel(
        rows,
        n_out,
        k_in,
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.contiguous().data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status == -2:
        raise MemoryError(f"no memory for the native {x.dtype} product of {rows} rows")
    assert status == 0, status
    return out
