"""A decoder linear layer holding FP8 (e4m3) weights (``--quantization fp8``).

``weight [out, in]`` holds e4m3 codes and ``weight_scale [out, 1]`` one float32 scale per
output channel. Both are parameters, so everything that counts the model's parameter bytes
counts FP8 bytes. On CUDA (compute capability 8.9+, bf16) the path depends on the row
count (``kernels.fp8_linear.fp8_linear_cuda``): a few rows (decode) take a weight-only
Triton GEMV that reads the FP8 weights once and multiplies the bf16 activation as it is;
more rows get one scale per token from one fused Triton kernel, then ``torch._scaled_mm``.
Anywhere else the float32 reference computes the second form (``kernels/fp8_linear.py``
has the arithmetic and its accuracy).

Where :meth:`Fp8Linear.wants_quantized_input` says so, the layer before quantizes for it:
the fused norm and SiLU kernels (``kernels/fused_fp8_ops.py``) write :class:`QuantizedRows`,
the very codes and scales the layer's own quantizer would compute from their bf16 output,
so that output is never written to memory and read back.

Weights arrive one shard at a time (q/k/v or gate/up into one packed layer) through
:meth:`Fp8Linear.load`: in a float dtype they are quantized by row there, which equals
quantizing the packed matrix (rows are independent); already in FP8 they are copied, with
their scale broadcast over the shard's rows (a per-tensor scale of a part becomes a
per-channel scale of the packed layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.fp8_kv import FP8_DTYPE
from kernels.fp8_linear import (
    WEIGHT_ONLY_MAX_ROWS,
    fp8_linear_cuda,
    fp8_matmul_reference,
    fp8_matmul_reference_quantized,
    quantize_rows,
    scaled_mm_quantized,
    scaled_mm_usable,
)


@dataclass(frozen=True)
class QuantizedRows:
    """An activation quantized by row as :func:`kernels.fp8_linear.quantize_rows` does:
    e4m3 ``codes [R, K]`` and float32 ``scales [R, 1]``."""

    codes: torch.Tensor
    scales: torch.Tensor


class Fp8Linear(nn.Module):
    """``y = x @ dequant(weight).T + bias`` (few rows on CUDA) or
    ``quant(x) @ dequant(weight).T + bias``; ``y`` in the model's dtype."""

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
            torch.empty(out_features, in_features, device=device, dtype=FP8_DTYPE),
            requires_grad=False,
        )
        self.weight_scale = nn.Parameter(
            torch.empty(out_features, 1, device=device, dtype=torch.float32), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False)
            if bias
            else None
        )
        self.out_dtype = dtype
        # NOTE: decided once here, not per call: the forward pass stays free of host queries.
        self.use_scaled_mm = scaled_mm_usable(device, dtype, in_features, out_features)

    def wants_quantized_input(self, rows: int) -> bool:
        """Whether an input of ``rows`` rows should come as :class:`QuantizedRows`: on the
        ``_scaled_mm`` path, above the weight-only GEMV's rows. A host int, so the choice
        costs no sync (and a captured decode graph keeps the one made at capture)."""
        return self.use_scaled_mm and rows > WEIGHT_ONLY_MAX_ROWS

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        if isinstance(x, QuantizedRows):
            return self._forward_quantized(x)
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        if self.use_scaled_mm and x.dtype == torch.bfloat16:
            out = fp8_linear_cuda(rows, self.weight, self.weight_scale, self.bias)
        else:
            out = fp8_matmul_reference(rows, self.weight, self.weight_scale, self.bias)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def _forward_quantized(self, x: QuantizedRows) -> torch.Tensor:
        """``[R, out]`` in the model dtype: what :meth:`forward` gives for the bf16 rows that
        ``x`` quantizes (above the GEMV's rows)."""
        assert x.codes.shape[1:] == (self.in_features,), (x.codes.shape, self.in_features)
        if self.use_scaled_mm:
            return scaled_mm_quantized(
                x.codes, x.scales, self.weight, self.weight_scale, self.out_dtype, self.bias
            )
        out = fp8_matmul_reference_quantized(
            x.codes, x.scales, self.weight, self.weight_scale, self.bias
        )
        return out.to(self.out_dtype)

    @torch.no_grad()
    def load(self, kind: str, tensor: torch.Tensor, start: int, size: int) -> tuple[str, ...]:
        """Write checkpoint tensor ``tensor`` into rows ``[start, start + size)``.

        ``kind`` is ``"weight"`` (float: quantized here, filling its scales too; e4m3:
        copied) or ``"weight_scale"`` (a scalar, ``[size]`` or ``[size, 1]``). Returns the
        parameter names it filled. ValueError on a shape that does not fit.
        """
        if kind == "weight":
            if tuple(tensor.shape) != (size, self.in_features):
                raise ValueError(
                    f"has shape {tuple(tensor.shape)}, expected {(size, self.in_features)}"
                )
            rows = self.weight.data.narrow(0, start, size)
            if tensor.dtype == FP8_DTYPE:
                rows.copy_(tensor)
                return ("weight",)
            codes, scale = quantize_rows(tensor.to(rows.device))
            rows.copy_(codes)
            self.weight_scale.data.narrow(0, start, size).copy_(scale)
            return ("weight", "weight_scale")
        if kind == "weight_scale":
            if tensor.numel() not in (1, size):
                raise ValueError(
                    f"has shape {tuple(tensor.shape)}: expected a scalar (per tensor) or "
                    f"{size} values (per channel)"
                )
            scale = tensor.to(torch.float32).reshape(-1, 1).expand(size, 1)
            self.weight_scale.data.narrow(0, start, size).copy_(scale)
            return ("weight_scale",)
        raise ValueError(f"an FP8 linear has no {kind!r}")

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
            f"fp8_e4m3, scaled_mm={self.use_scaled_mm}"
        )
