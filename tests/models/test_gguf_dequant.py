"""The torch GGUF dequantizer against gguf's numpy one: bit for bit, every format it handles."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

from ragserve.models.gguf_dequant import dequantize


@pytest.mark.parametrize(
    "tensor_type",
    [
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.F16,  # through gguf's own path
        GGMLQuantizationType.F32,
    ],
)
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 96)])
def test_matches_gguf_bit_for_bit(
    tensor_type: GGMLQuantizationType, shape: tuple[int, ...]
) -> None:
    rng = np.random.default_rng(0)
    values = (rng.standard_normal(shape) * rng.uniform(0.01, 10, shape[:-1] + (1,))).astype(
        np.float32
    )
    values[0, ..., :32] = 0.0  # an all-zero block (scale 0)
    data = quantize(values, tensor_type)
    data.flags.writeable = False  # as the memory map hands it over
    expected = torch.from_numpy(np.array(gguf_dequantize(data, tensor_type)))
    got = dequantize(data, tensor_type)
    assert got.dtype == torch.float32 and got.shape == expected.shape == shape
    assert torch.equal(got, expected)
