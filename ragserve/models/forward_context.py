"""Hands the attention metadata and KV cache to attention layers for one forward pass.

The model runner sets the context around ``model(...)``; model code reads it in its
attention layers, so neither the model nor its signature knows about scheduling.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kernels.interface import AttentionBackend, AttentionMetadata


@dataclass(frozen=True)
class OutputRows:
    """The rows of a flat batch whose final hidden states are needed: the rows sampled from.

    Each is the last new token of its sequence, so in the model's last layer it attends like
    a decode; ``meta`` describes those rows alone (one query each, over its whole context).
    The other rows need only their K/V stored there: no token attends to a later layer.
    """

    indices: torch.Tensor  # [R] int64: rows of the batch, ascending
    meta: AttentionMetadata

    @property
    def count(self) -> int:
        return self.meta.num_seqs


@dataclass(frozen=True)
class ForwardContext:
    meta: AttentionMetadata
    kv_cache: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    backend: AttentionBackend


_current: ForwardContext | None = None


@contextmanager
def forward_context(context: ForwardContext) -> Iterator[None]:
    global _current
    assert _current is None, "forward contexts do not nest"
    _current = context
    try:
        yield
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    assert _current is not None, "attention ran outside a forward_context()"
    return _current
