"""Dequantize GGUF tensors with torch: the block formats of the embedded model in whole-tensor
operations, every other format through ``gguf.quants.dequantize``.

``gguf``'s numpy dequantization walks row groups in Python: 3.5 s of the embedded
SmolLM2-135M's start-up (210 Q4_1 tensors) against about 0.1 s here. The arithmetic is the
same operations in the same order in float32 (a product, then a sum; never fused), so the
results are bit-identical to ``gguf``'s (``tests/models/test_gguf_dequant.py``).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

QK = 32  # weights per block in Q4_0, Q4_1 and Q8_0


def _halves(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Float16 field at byte ``start`` of each block ``[n, bytes]`` as float32 ``[n, 1]``."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[n, 16]`` bytes -> ``[n, 32]``: the low nibbles of all bytes, then the high ones."""
    return torch.cat([packed & 0x0F, packed >> 4], dim=1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _halves(blocks, 0)
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return d * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _halves(blocks, 0), _halves(blocks, 2)
    return d * _nibbles(blocks[:, 4:]).float() + m


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _halves(blocks, 0)
    return blocks[:, 2:].contiguous().view(torch.int8).float() * d


_BLOCK_FORMATS = {
    GGMLQuantizationType.Q4_0: (18, _q4_0),
    GGMLQuantizationType.Q4_1: (20, _q4_1),
    GGMLQuantizationType.Q8_0: (34, _q8_0),
}


def dequantize(data: np.ndarray, tensor_type: GGMLQuantizationType) -> torch.Tensor:
    """``data`` as ``GGUFHeader.tensor_data`` returns it, as a float32 tensor of the logical shape."""
    block_format = _BLOCK_FORMATS.get(tensor_type)
    if block_format is None:
        array = gguf_dequantize(data, tensor_type)
        # NOTE: unquantized tensors come back as read-only views of the memory map.
        return torch.from_numpy(array if array.flags.writeable else array.copy())
    block_bytes, kernel = block_format
    rows_shape = data.shape[:-1]
    # NOTE: a copy: ``data`` is a read-only view of the memory map (about 1 byte a weight)
    blocks = torch.from_numpy(np.array(data)).reshape(-1, block_bytes)
    width = data.shape[-1] // block_bytes * QK
    return kernel(blocks).reshape(*rows_shape, width)
