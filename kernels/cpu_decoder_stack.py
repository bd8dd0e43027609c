"""A run of Llama decoder layers in one native call (``csrc/cpu_decoder_stack.c``).

A decode step of a small model is hundreds of kernel calls, each a few microseconds of work
behind 10-30 us of Python: module dispatch, views, allocations, ctypes. For steps of a few
rows (decode steps, short questions), float32 or bf16, the native library runs the layers'
loop itself, calling the same kernels in the same order as the per-op path, so the results
are bit-identical to it (and float32 stays token-identical to transformers); only the
Python between the calls is gone.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels import cpu_native
from kernels.cpu_linear import kept_transposed

_WEIGHTS = (
    "input_norm",
    "qkv",
    "qkv_bias",
    "o",
    "o_bias",
    "post_norm",
    "gate_up",
    "gate_up_bias",
    "down",
    "down_bias",
)
_PAIRS = ("qkv_pairs", "o_pairs", "gate_up_pairs", "down_pairs")


class _LayerWeights(ctypes.Structure):
    """Mirror of ``LayerWeights`` in the C file: the pointers named in ``_WEIGHTS`` and
    ``_PAIRS``."""

    _fields_ = [(name, ctypes.c_void_p) for name in (*_WEIGHTS, *_PAIRS)]


class _DecoderStack(ctypes.Structure):
    """Mirror of ``DecoderStack`` in the C file."""

    _fields_ = [
        ("num_layers", ctypes.c_int32),
        ("rows", ctypes.c_int32),
        ("hidden_size", ctypes.c_int32),
        ("num_heads", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("intermediate_size", ctypes.c_int32),
        ("threads", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("is_bf16", ctypes.c_int32),
        ("layer_stride", ctypes.c_int64),
        ("layers", ctypes.POINTER(_LayerWeights)),
        ("attn", ctypes.POINTER(cpu_native.AttnParams)),
        ("slots", ctypes.c_void_p),
        ("kv", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("hidden", ctypes.c_void_p),
        ("residual", ctypes.c_void_p),
    ]


@dataclass(frozen=True)
class LayerTensors:
    """One decoder layer's weights, as the per-op path uses them (fused qkv and gate/up);
    the ``*_pairs`` are the bf16 projections' paired copies (``Linear.pairs``), or None."""

    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    qkv_pairs: torch.Tensor | None = None
    o_pairs: torch.Tensor | None = None
    gate_up_pairs: torch.Tensor | None = None
    down_pairs: torch.Tensor | None = None


def _pointer(tensor: torch.Tensor | None, dtype: torch.dtype) -> int | None:
    if tensor is None:
        return None
    # NOTE: float32 projections are stored transposed, as the native float32 products read
    # them; bf16 ones, norms and biases as they are.
    stored = tensor.t() if kept_transposed(tensor) else tensor
    assert stored.is_contiguous() and tensor.dtype == dtype
    return tensor.data_ptr()


class StackWeights:
    """Every layer's weight pointers in the C layout, gathered once (not once per step).

    NOTE: it points into the tensors it holds, so it stays valid while they are written in
    place (as loaders do); whoever replaces a weight tensor builds a new one. The paired
    copies are copies: writing a weight in place leaves them stale until the model packs
    its weights again (``pack_cpu_weights``, which drops this gathering too).
    """

    def __init__(self, layers: Sequence[LayerTensors], dtype: torch.dtype) -> None:
        self.layers = tuple(layers)
        self.dtype = dtype
        self.intermediate_size = self.layers[0].gate_up.shape[0] // 2
        self.paired = all(getattr(layer, name) is not None for layer in layers for name in _PAIRS)
        self.array = (_LayerWeights * len(self.layers))()
        for entry, layer in zip(self.array, self.layers, strict=True):
            for name in _WEIGHTS:
                setattr(entry, name, _pointer(getattr(layer, name), dtype))
            for name in _PAIRS:
                pairs = getattr(layer, name)
                setattr(entry, name, None if pairs is None else pairs.data_ptr())


def run(
    weights: StackWeights,
    num_layers: int,
    embeddings: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    attention: cpu_native.AttnParams,
    slots: torch.Tensor,
    kv_cache: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(last layer's MLP output, residual stream)`` after the first ``num_layers`` layers
    of ``weights``, as the per-op loop returns them; ``embeddings [rows, hidden]``
    (contiguous, the weights' dtype) become the residual stream.

    ``attention`` is the step's layout (``CpuBackend.native_layout``), ``slots`` its int64
    cache slots, ``kv_cache`` the whole cache (layer ``i`` of ``weights`` is its layer ``i``),
    ``cos``/``sin`` the rows' rotary tables ``[rows, 1, head_dim / 2]``.
    """
    library = cpu_native.load()
    assert library is not None and embeddings.is_contiguous()
    assert embeddings.dtype == weights.dtype and 0 < num_layers <= len(weights.layers)
    rows, hidden_size = embeddings.shape
    hidden = torch.empty_like(embeddings)
    stack = _DecoderStack(
        num_layers=num_layers,
        rows=rows,
        hidden_size=hidden_size,
        num_heads=attention.num_heads,
        num_kv_heads=attention.num_kv_heads,
        head_dim=attention.head_dim,
        intermediate_size=weights.intermediate_size,
        threads=torch.get_num_threads(),
        eps=eps,
        is_bf16=embeddings.dtype == torch.bfloat16,
        layer_stride=kv_cache.stride(1),
        layers=weights.array,
        attn=ctypes.pointer(attention),
        slots=slots.data_ptr(),
        kv=kv_cache.data_ptr(),
        cos=_pointer(cos, embeddings.dtype),
        sin=_pointer(sin, embeddings.dtype),
        hidden=hidden.data_ptr(),
        residual=embeddings.data_ptr(),
    )
    status = library.ragserve_decoder_stack(ctypes.byref(stack))
    if status == -2:
        raise MemoryError(f"no memory for the native decoder layers of a {rows}-row step")
    if status != 0:
        raise RuntimeError(f"the native decoder layers refused a {rows}-row step ({status})")
    return hidden, embeddings
