"""Attention backends over the paged, block-major KV cache."""

from kernels.interface import AttentionBackend, AttentionMetadata, write_kv
from kernels.registry import available_backends, get_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "available_backends", "get_backend", "write_kv"]
