"""Small CPU steps through the decoder layers in one native call.

A decode step or a short question on the CPU is a few microseconds of work per kernel and
hundreds of kernels; the Python between them (module calls, views, allocations) took a
quarter of a batch-1 step of SmolLM2. Where a step's rows are few enough for the native
products (``kernels/cpu_decoder_stack.py``), the layers run in one call instead: the same
kernels in the same order, so the results are bit-identical to the per-op path (float32
stays token-identical to transformers), which stays the path for everything else (prefill
chunks, float16, FP8, Qwen3's q/k norms, GPUs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kernels import cpu_decoder_stack, cpu_linear
from kernels.cpu_backend import CpuBackend
from kernels.cpu_decoder_stack import LayerTensors
from ragserve.models.forward_context import OutputRows, get_forward_context
from ragserve.models.layers import Linear
from ragserve.models.rotary import Rotation

if TYPE_CHECKING:
    from ragserve.models.llama import LlamaDecoderLayer, LlamaModel, ModelShape


def shapes_fit(shape: ModelShape, qk_norm: bool, quantization: str) -> bool:
    """Whether a model of this shape can ever take the native layers: plain projections (no
    FP8), no q/k norms, and every product's inner size a multiple of 32 (bf16 pairs, and a
    multiple of any vector width for float32)."""
    sizes = (
        shape.hidden_size,
        shape.num_heads * shape.head_dim,
        shape.intermediate_size,
        shape.head_dim,
    )
    return quantization == "none" and not qk_norm and all(size % 32 == 0 for size in sizes)


def _tensors(layer: LlamaDecoderLayer) -> LayerTensors:
    attention, mlp = layer.self_attn, layer.mlp
    return LayerTensors(
        input_norm=layer.input_layernorm.weight,
        qkv=attention.qkv_proj.weight,
        qkv_bias=attention.qkv_proj.bias,
        o=attention.o_proj.weight,
        o_bias=attention.o_proj.bias,
        post_norm=layer.post_attention_layernorm.weight,
        gate_up=mlp.gate_up_proj.weight,
        gate_up_bias=mlp.gate_up_proj.bias,
        down=mlp.down_proj.weight,
        down_bias=mlp.down_proj.bias,
        qkv_pairs=_pairs(attention.qkv_proj),
        o_pairs=_pairs(attention.o_proj),
        gate_up_pairs=_pairs(mlp.gate_up_proj),
        down_pairs=_pairs(mlp.down_proj),
    )


def _pairs(projection: torch.nn.Module) -> torch.Tensor | None:
    return projection.pairs if isinstance(projection, Linear) else None


def run_native_layers(
    model: LlamaModel,
    embeddings: torch.Tensor,
    rotation: Rotation,
    output_rows: OutputRows | None,
) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """``(hidden, residual, layers run)`` after running the first layers natively: all of
    them, or all but the last when it computes only some rows (``output_rows``); None where
    this step cannot (the caller runs every layer itself)."""
    count = len(model.layers) - (output_rows is not None)
    rows = embeddings.shape[0]
    if (
        count < 1
        or not model.native_shapes
        or rotation.fused
        or embeddings.device.type != "cpu"
        or not 0 < rows <= cpu_linear.max_rows(embeddings.dtype)
    ):
        return None
    context = get_forward_context()
    if not isinstance(context.backend, CpuBackend):
        return None
    layers: list[LlamaDecoderLayer] = list(model.layers)  # type: ignore[arg-type]
    weights = model.native_weights
    if weights is None or weights.dtype != embeddings.dtype:
        weights = cpu_decoder_stack.StackWeights(
            [_tensors(layer) for layer in layers], embeddings.dtype
        )
        model.native_weights = weights
    if not cpu_linear.multiplies_natively(rows, embeddings.dtype, weights.paired):
        return None
    attention = layers[0].self_attn
    layout = context.backend.native_layout(
        context.meta, context.kv_cache[:, 0], attention.num_heads, embeddings.dtype, attention.scale
    )
    if layout is None:
        return None
    params, slots = layout
    hidden, residual = cpu_decoder_stack.run(
        weights,
        count,
        embeddings,
        rotation.cos,
        rotation.sin,
        params,
        slots,
        context.kv_cache,
        layers[0].input_layernorm.eps,
    )
    return hidden, residual, count
