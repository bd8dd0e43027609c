"""Building blocks of the decoder: an uninitialised Linear and an RMSNorm matching HF numerics.

Parameters are allocated with ``torch.empty`` directly on the target device and dtype: the
loader overwrites every one of them, so a random init would only cost time (seconds on the
CPU for 8B shapes).
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_layer_ops
from kernels.cpu_linear import (
    PAIRS_LINEAR_MAX_ROWS,
    WIDE_MIN_ROWS,
    can_pack,
    empty_weight,
    fuses_silu_mul,
    kept_transposed,
    pack_weight,
    packed_linear,
    pair_weight,
    pairs_apply,
    pairs_linear,
    pairs_silu_mul,
    small_linear,
    small_linear_usable,
    store_transposed,
    wide_linear,
    widen_weight,
    widens,
)


def use_fused_kernels(x: torch.Tensor) -> bool:
    """Half-precision CUDA activations take the fused Triton kernels (``kernels/fused_ops.py``).

    float32 and the CPU keep the eager torch code: the exact reference against transformers.
    """
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


def fused_ops() -> ModuleType:
    # NOTE: imported on first GPU use only: importing Triton kernels fixes their mode
    # (compiled, or interpreted on the CPU in tests), which must stay the tests' choice.
    from kernels import fused_ops as module

    return module


def fused_fp8_ops() -> ModuleType:
    """``kernels/fused_fp8_ops.py``, imported on first use as :func:`fused_ops` is."""
    from kernels import fused_fp8_ops as module

    return module


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` of shape ``[out_features, in_features]``.

    float32 CPU weights are stored transposed (``weight.t()`` contiguous), as the native
    products of a few rows read them. After :meth:`pack_for_cpu`, bf16 CPU weights run from a
    copy paired for AVX-512 BF16 or else a prepacked oneDNN copy (``kernels/cpu_linear.py``);
    ``weight`` stays the source of truth.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(
            empty_weight(out_features, in_features, device=device, dtype=dtype),
            requires_grad=False,
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False)
            if bias
            else None
        )
        self._packed: torch.Tensor | None = None
        self._wide: torch.Tensor | None = None
        self.pairs: torch.Tensor | None = None  # bf16 products' paired copy, see pack_for_cpu

    def pack_for_cpu(self, widen: bool = True, pair: bool = True) -> None:
        """With ``pair``, keep a bf16 CPU weight in pairs for the native products where the
        CPU has AVX-512 BF16 and no AMX (``pairs``), else prepack it for oneDNN when it can be;
        with ``widen``, keep a float32 copy for long products where this CPU runs them faster
        so (``kernels/cpu_linear.py``); else drop any old copies. A
        float32 CPU weight given a plain layout (``weight.data = ...``) is stored transposed
        again.

        Call again after every change to ``weight``: the copies do not follow it.
        """
        if kept_transposed(self.weight) and not self.weight.t().is_contiguous():
            self.weight.data = store_transposed(self.weight.data)
        self.pairs = pair_weight(self.weight) if pair and pairs_apply(self.weight) else None
        self._wide = widen_weight(self.weight) if widen and widens(self.weight) else None
        # NOTE: a paired weight multiplies every row count over its pairs (or widened).
        packs = self.pairs is None and can_pack(self.weight)
        self._packed = pack_weight(self.weight) if packs else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if small_linear_usable(x, self.weight, self.pairs):
            return small_linear(x, self.weight, self.bias, self.pairs)
        if self.widens_rows(x):
            return wide_linear(x, self._wide, self.bias)  # type: ignore[arg-type]
        if self.pairs is not None and x.dtype == self.weight.dtype:
            return pairs_linear(x, self.pairs, self.bias, self.out_features)
        if self._packed is not None and x.dtype == self.weight.dtype:
            return packed_linear(x, self._packed, self.bias)
        return F.linear(x, self.weight, self.bias)

    def widens_rows(self, x: torch.Tensor) -> bool:
        """Whether ``x``'s product runs in float32 over the widened copy (long bf16 products
        where this CPU multiplies float32 faster)."""
        return (
            self._wide is not None
            and x.dtype == self.weight.dtype
            and x.numel() >= WIDE_MIN_ROWS * self.in_features
        )

    def pairs_silu_mul(self, x: torch.Tensor, intermediate_size: int) -> torch.Tensor | None:
        """``silu(gate) * up`` of this gate/up projection of ``x [rows, in]`` in one pass
        where its bf16 product of ``x`` runs over the pairs for more rows than a decode step
        (``kernels/cpu_linear.py``, :func:`pairs_silu_mul`), the same bits as the product and
        a separate SiLU pass; else None."""
        if (
            self.pairs is None
            or x.dim() != 2
            or x.dtype != self.weight.dtype
            or x.shape[0] <= PAIRS_LINEAR_MAX_ROWS
            or not fuses_silu_mul(intermediate_size)
            or self.widens_rows(x)
        ):
            return None
        return pairs_silu_mul(x, self.pairs, self.bias, intermediate_size)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim.

    NOTE: same op order as HF's LlamaRMSNorm (normalise in float32, cast back to the input
    dtype, then multiply by the weight) so half-precision results match it bit for bit.
    """

    def __init__(self, size: int, eps: float, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.empty(size, device=device, dtype=dtype), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and use_fused_kernels(x):
            return fused_ops().rms_norm(x, self.weight, self.eps)
        if x.dim() == 2 and x.is_contiguous() and cpu_layer_ops.usable(x, self.weight):
            return cpu_layer_ops.add_rms_norm(None, x, self.weight, self.eps)
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(input_dtype)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(residual + x), residual + x)``: one residual add and the next layer's norm.

        The fused kernels (CUDA, and native on the CPU) write the sum into ``residual`` itself.
        """
        if use_fused_kernels(x):
            return fused_ops().rms_norm(x, self.weight, self.eps, residual=residual), residual
        if (
            x.dim() == 2
            and x.is_contiguous()
            and residual.is_contiguous()
            and cpu_layer_ops.usable(x, residual, self.weight)
        ):
            return cpu_layer_ops.add_rms_norm(x, residual, self.weight, self.eps), residual
        summed = residual + x
        return self.forward(summed), summed

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


class Embedding(nn.Module):
    """Token embedding table ``weight [vocab_size, hidden_size]``."""

    def __init__(
        self, vocab_size: int, hidden_size: int, *, device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(vocab_size, hidden_size, device=device, dtype=dtype), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)
