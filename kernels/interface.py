"""The contract every attention backend implements.

The KV cache of an engine is one block-major tensor
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; a layer sees
its slice ``kv_cache[:, layer]`` of shape ``[num_blocks, 2, block_size, num_kv_heads, head_dim]``
(index 0 along dim 1 is K, 1 is V). A *slot* is ``block_id * block_size + offset``.

An 8-bit cache (``--kv-cache-dtype fp8``: ``uint8`` holding e4m3 codes; ``int8``:
``torch.int8`` holding int8 codes) has the same block-major shape with a last dim of
``head_dim + 4``, but each slot's ``[num_kv_heads, head_dim + 4]`` bytes are one record:
all heads' codes, then all heads' float32 scales (``kernels/fp8_kv.py``), so only the
8-bit readers index into a slot. ``write_kv`` quantizes into it; a backend that cannot
read it says so with ``supports_quantized_kv = False`` and refuses it at start-up
(``check_kv_cache``).

A forward pass runs over a flat batch of ``T`` new tokens belonging to ``B`` sequences,
sequence ``i`` owning query rows ``query_start_loc[i]:query_start_loc[i + 1]``. Each
sequence's new tokens are the last ``query_len`` of its ``seq_len`` context tokens:
they attend causally among themselves and fully over the cached context before them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kernels.fp8_kv import is_fp8_cache, is_quantized_cache, quantize_slots


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each new token's K/V goes and what each sequence attends over.

    Tensors live on the model's device; the ``*_host`` lists are the same numbers on the
    host, so CPU-side backends never synchronise with the device to read them.
    """

    slot_mapping: torch.Tensor  # [T] int64: slot of each new token
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32: context length including the new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, rows padded with 0
    query_lens_host: list[int]
    seq_lens_host: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache, then attends each query over its context."""

    name: str
    # True when forward reads only the metadata's device tensors (never the host lists,
    # beyond sizing its grid), so a CUDA graph captured once replays right for new inputs.
    supports_cuda_graphs: bool = False
    # True when forward reads an 8-bit cache of either kind (``kernels/fp8_kv.py``) as well
    # as a plain one.
    supports_quantized_kv: bool = False

    def check_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """ValueError, at start-up, for a cache this backend cannot read."""
        if is_quantized_cache(kv_cache) and not self.supports_quantized_kv:
            kind = "FP8" if is_fp8_cache(kv_cache) else "INT8"
            raise ValueError(
                f"the {self.name!r} attention backend cannot read an {kind} KV cache yet; "
                "use --attention-backend reference (or --kv-cache-dtype auto)"
            )

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Store ``key``/``value`` at ``meta.slot_mapping`` in ``kv_layer``, return attention output."""

    def store_kv(
        self,
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_layer: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
    ) -> None:
        """Store new K/V without attending: rows whose attention output nobody reads."""
        write_kv(key, value, kv_layer, slot_mapping)

    def warm_up(  # noqa: B027 (optional hook; most backends have nothing to prepare)
        self,
        query_shape: tuple[int, int, int],  # (tokens, num_heads, head_dim) of the longest step
        num_kv_heads: int,
        max_context_len: int,  # the longest sequence a step may attend over
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """Prepare, at start-up, what the first requests would otherwise wait for."""


def slot_rows(kv_layer: torch.Tensor) -> torch.Tensor:
    """A 2-D view ``[rows, kv_heads * head_dim]`` whose row ``b * stride + o`` is block b's K slot o.

    Row ``b * stride + block_size + o`` is the V slot. The view starts at this layer and
    spans the rest of the block-major storage, so scatters into it are plain row copies.
    """
    num_blocks, _, block_size, heads, dim = kv_layer.shape
    rows_per_block = kv_layer.stride(0) // (heads * dim)
    num_rows = (num_blocks - 1) * rows_per_block + 2 * block_size
    return kv_layer.as_strided((num_rows, heads * dim), (heads * dim, 1), kv_layer.storage_offset())


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new K/V rows into their slots (pure torch; used by the reference backend).

    Into an 8-bit cache the slots are quantized first, each (token, kv head) row on its own."""
    scatter_rows(cache_rows(key, kv_layer), cache_rows(value, kv_layer), kv_layer, slot_mapping)


def cache_rows(x: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
    """``[T, kv_heads, head_dim]`` as the ``[T, kv_heads, row_width]`` slots ``kv_layer`` stores."""
    if is_quantized_cache(kv_layer):
        return quantize_slots(x, kv_layer.dtype)
    return x.to(kv_layer.dtype)


def scatter_rows(
    key_rows: torch.Tensor,  # [T, kv_heads, row_width] in the cache's dtype (``cache_rows``)
    value_rows: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Copy slots already in the cache's format into place: whole slots, so an 8-bit slot's
    codes and scales move together."""
    block_size, heads, width = kv_layer.shape[2:]
    rows_per_block = kv_layer.stride(0) // (heads * width)
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    key_slots = blocks * rows_per_block + slot_mapping % block_size
    rows = slot_rows(kv_layer)
    rows.index_copy_(0, key_slots, key_rows.reshape(-1, heads * width))
    rows.index_copy_(0, key_slots + block_size, value_rows.reshape(-1, heads * width))
