"""Linear layers on the CPU: bfloat16 weights prepacked once into oneDNN's blocked layout,
and float32 products of up to 64 rows (decode steps) through native kernels
(``csrc/cpu_small_linear.c``).

A decode step multiplies one token by every weight matrix, so it streams all the weights
from memory once per step. ``F.linear`` on a plain bf16 weight reads them at ~14 GB/s on a
2-core AVX-512 BF16 EPYC; the same product over a prepacked weight reads at ~18 GB/s (30
SmolLM2-135M layers: 15.4 -> 11.5 ms; its 49152 x 576 LM head: 3.7 -> 2.5 ms). Results are
bit-identical to ``F.linear`` (both are oneDNN inner products; only the weight layout differs).

A packed weight is a copy: it costs the weight's size again in memory and goes stale when
the plain weight changes, so whoever writes weights packs again afterwards.
"""

from __future__ import annotations

import torch

from kernels import cpu_native

# NOTE: oneDNN picks the blocked layout for a batch size; 1 is the decode step, the case
# whose speed is bound by reading the weights. Larger batches run correctly on it too.
_DECODE_BATCH_HINT = 1


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
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _DECODE_BATCH_HINT)


# NOTE: from about this many rows on (long prefill chunks) oneDNN multiplies faster from the
# plain weight than from the decode-shaped packing: 2.1-2.5 against 1.7-1.9 TFLOP/s at 1,536
# to 2,048 rows of SmolLM2's projections on 2 AMX cores; below it the packing is as fast or faster.
PACKED_MAX_ROWS = 1535


def use_packed(x: torch.Tensor) -> bool:
    """Whether ``x``'s rows go through the packed weight (decode steps, short chunks)."""
    return x.numel() <= PACKED_MAX_ROWS * x.shape[-1]


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x [..., in]`` in bf16, ``packed`` from :func:`pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# NOTE: as csrc/cpu_small_linear.c's SMALL_LINEAR_MAX_ROWS. From about this many rows on,
# MKL's blocked GEMM (prefill chunks) is as fast.
SMALL_LINEAR_MAX_ROWS = 64


def small_linear_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True for ``x [rows <= SMALL_LINEAR_MAX_ROWS, in]`` and ``weight [out, in]``, both
    contiguous float32 CPU tensors, ``in`` a multiple of the vector width, with the native
    kernels built."""
    if not (
        x.dim() == 2
        and 0 < x.shape[0] <= SMALL_LINEAR_MAX_ROWS
        and x.dtype == weight.dtype == torch.float32
        and x.device.type == weight.device.type == "cpu"
        and x.is_contiguous()
        and weight.is_contiguous()
    ):
        return False
    width = cpu_native.vector_width()
    return width is not None and x.shape[1] % width == 0


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for inputs :func:`small_linear_usable` accepts, 1.3x to 3x
    ``F.linear``'s rate at decode batches (see the C file). Each row's result is the same
    whatever the other rows are."""
    library = cpu_native.load()
    assert library is not None
    rows, k_in = x.shape
    n_out = weight.shape[0]
    out = torch.empty((rows, n_out), dtype=torch.float32)
    status = library.ragserve_small_linear(
        rows,
        n_out,
        k_in,
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.contiguous().data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    assert status == 0
    return out
