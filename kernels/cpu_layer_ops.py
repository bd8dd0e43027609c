"""A decoder layer's element-wise work on the CPU in one native call each (``csrc/cpu_layer_ops.c``).

Eager torch spends 6-10 small ops on a residual add + RMSNorm, three on SiLU(gate) * up
and about eight on a rotary embedding; on two cores a decode step of SmolLM2 ran ~900 such
ops. Each function here is one call with the same op order and roundings as transformers
(see the C file). :func:`usable` says whether a tensor can take them; callers keep their
torch code for everything else (no native library, float16, odd strides or sizes).
"""

from __future__ import annotations

import torch

from kernels import cpu_native

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def usable(*tensors: torch.Tensor) -> bool:
    """True when the native ops are built and every tensor is a float32/bf16 CPU tensor of
    one dtype whose last dimension is contiguous and a multiple of the vector width."""
    dtype = tensors[0].dtype
    if dtype not in _DTYPES or not all(
        t.device.type == "cpu" and t.dtype == dtype and t.stride(-1) == 1 for t in tensors
    ):
        return False
    width = cpu_native.vector_width()
    return width is not None and all(t.shape[-1] % width == 0 for t in tensors)


def add_rms_norm(
    x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``weight * norm(residual + x)``; the sum is written into ``residual`` (None: norm of ``residual``).

    ``x`` and ``residual`` are ``[rows, hidden]`` with contiguous rows.
    """
    library = cpu_native.load()
    assert library is not None
    rows, cols = residual.shape
    assert residual.is_contiguous() and (
        x is None or (x.is_contiguous() and x.shape == residual.shape)
    )
    out = torch.empty_like(residual)
    status = library.ragserve_add_rms_norm(
        _DTYPES[residual.dtype],
        rows,
        cols,
        None if x is None else x.data_ptr(),
        residual.data_ptr(),
        weight.data_ptr(),
        eps,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    assert status == 0
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [rows, 2 * inter]`` (rows may be strided): ``[rows, inter]``."""
    library = cpu_native.load()
    assert library is not None
    rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype)
    status = library.ragserve_silu_mul(
        _DTYPES[gate_up.dtype],
        rows,
        inter,
        gate_up.data_ptr(),
        gate_up.stride(0),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    assert status == 0
    return out


def rotate(heads: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``heads [T, n, D]`` (each token's heads contiguous, any token
    stride) by ``cos``/``sin`` rows ``[T, 1, D / 2]``: a new contiguous ``[T, n, D]``."""
    library = cpu_native.load()
    assert library is not None
    tokens, count, dim = heads.shape
    assert heads.stride(1) == dim and cos.is_contiguous() and sin.is_contiguous()
    out = torch.empty((tokens, count, dim), dtype=heads.dtype)
    library.ragserve_rotary(
        _DTYPES[heads.dtype],
        tokens,
        count,
        dim,
        heads.data_ptr(),
        heads.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        out.data_ptr(),
        count * dim,
        torch.get_num_threads(),
    )
    return out
