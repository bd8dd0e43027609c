"""Building blocks of the decoder: an uninitialised Linear and an RMSNorm matching HF numerics.

Parameters are allocated with ``torch.empty`` directly on the target device and dtype: the
loader overwrites every one of them, so a random init would only cost time (seconds on the
CPU for 8B shapes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """``y = x @ weight.T + bias`` with ``weight`` of shape ``[out_features, in_features]``."""

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
            torch.empty(out_features, in_features, device=device, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False)
            if bias
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

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
        self.weight = nn.Parameter(torch.empty(size, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(input_dtype)

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
