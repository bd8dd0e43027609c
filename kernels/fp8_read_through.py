"""A plain pure-torch backend run over an 8-bit cache: quantized writes, dequantized reads.

Either kind of ``kernels/fp8_kv.py`` (e4m3 or int8 codes, told by the cache's dtype). Each
layer call quantizes the new K/V into the cache (``interface.scatter_rows``), then
dequantizes the blocks this step reads into a compact dense layer (``[used blocks, 2,
block_size, kv_heads, head_dim]`` in the query's dtype) and hands the step, with its block
tables and slots renumbered into that layer, to the plain backend. So attention runs in
the query's dtype over exactly the values the cache holds. int8 rows stay in the basis
they are stored in (``kernels/kv_rotation.py``): the queries are rotated into it and the
output back, which keeps every score.

NOTE: the new tokens' own K/V are passed on round-tripped through the 8-bit format too. A chunk with
nothing cached before it attends over the K/V in hand; were those left exact, its output
would differ from the same tokens read back from the cache, and outputs would depend on
chunk size and on prefix hits (the engine's invariant is that they do not).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kernels.cpu_paged_attention import GatherWorkspace
from kernels.fp8_kv import SCALE_BYTES, dequantize_slots, quantize_slots, stores_rotated_rows
from kernels.interface import AttentionBackend, AttentionMetadata, scatter_rows
from kernels.kv_rotation import rotate_queries


@dataclass(frozen=True)
class _DenseStep:
    meta: AttentionMetadata  # the step as the engine gave it
    layout: tuple[object, ...]  # the 8-bit layer's shape and block stride
    blocks: torch.Tensor  # int64: the cache blocks the step reads, in dense order
    dense_meta: AttentionMetadata  # the same step over the dense layer


class Fp8ReadThrough:
    """Serves one forward pass at a time for ``plain`` (its plans are per pass)."""

    def __init__(self, plain: AttentionBackend) -> None:
        self._plain = plain
        self._step: _DenseStep | None = None
        # NOTE: two workspaces: the plain backend gathers from the dense layer into its own.
        self._codes = GatherWorkspace()
        self._dense = GatherWorkspace()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_layer: torch.Tensor,  # 8-bit [num_blocks, 2, block_size, kv_heads, head_dim + 4]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        key_rows = quantize_slots(key, kv_layer.dtype)
        value_rows = quantize_slots(value, kv_layer.dtype)
        scatter_rows(key_rows, value_rows, kv_layer, meta.slot_mapping)
        step = self._plan(meta, kv_layer)
        dense = self.dequantize_blocks(kv_layer, step.blocks, query.dtype)
        # NOTE: int8 rows stay in H's basis (kernels/kv_rotation.py): rotating the queries
        # and the output is far less work than unrotating every context row of every step.
        key, value = (
            dequantize_slots(key_rows, query.dtype, unrotate=False),
            dequantize_slots(value_rows, query.dtype, unrotate=False),
        )
        if not stores_rotated_rows(kv_layer):
            return self._plain.forward(query, key, value, dense, step.dense_meta, scale)
        out = self._plain.forward(rotate_queries(query), key, value, dense, step.dense_meta, scale)
        return rotate_queries(out)

    def dequantize_blocks(
        self, kv_layer: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """``[len(blocks), 2, block_size, kv_heads, head_dim]`` of ``dtype`` (int8 rows left
        in ``H``'s basis): a workspace view, valid until the next call."""
        shape = (blocks.numel(), *kv_layer.shape[1:])
        codes = self._codes.take(shape, kv_layer.dtype, kv_layer.device)
        torch.index_select(kv_layer, 0, blocks, out=codes)
        dense = self._dense.take((*shape[:-1], shape[-1] - SCALE_BYTES), dtype, kv_layer.device)
        return dequantize_slots(codes, dtype, out=dense, unrotate=False)

    def _plan(self, meta: AttentionMetadata, kv_layer: torch.Tensor) -> _DenseStep:
        layout = (*kv_layer.shape, kv_layer.stride(0))
        step = self._step
        if step is not None and step.meta is meta and step.layout == layout:
            return step
        block_size = kv_layer.shape[2]
        # NOTE: sorted, so searchsorted renumbers; padding ids (0) just add one block.
        blocks = torch.unique(meta.block_tables.long())
        tables = torch.searchsorted(blocks, meta.block_tables.long()).to(torch.int32)
        slot_blocks = torch.div(meta.slot_mapping, block_size, rounding_mode="floor")
        slots = (
            torch.searchsorted(blocks, slot_blocks) * block_size + meta.slot_mapping % block_size
        )
        dense_meta = replace(meta, block_tables=tables, slot_mapping=slots)
        step = self._step = _DenseStep(meta, layout, blocks, dense_meta)
        return step
