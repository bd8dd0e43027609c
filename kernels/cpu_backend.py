"""The CPU attention backend: paged K/V read in place by native kernels, pure torch otherwise.

With the native kernels (``kernels/csrc/cpu_attention.c``, built on first use by
``kernels/cpu_native.py``) one call per layer stores the new K/V and attends the whole mixed
prefill+decode batch: each query walks its own block table, flash-style, with no gathered
copy and no mask. Where they cannot run (no compiler, float16, an unsupported head size),
the same backend runs pure torch: decodes as the reference backend does, and prefill chunks
over cached context as two fused flash calls (causal over the chunk's own K/V, full over the
gathered context) merged by their log-sum-exp.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch

from kernels import cpu_native
from kernels.cpu_decode_attention import attend_decode_heads
from kernels.cpu_paged_attention import (
    ContextPlan,
    GatherWorkspace,
    causal_self_attention,
    plan_decode,
    prefill_attention_split,
)
from kernels.interface import AttentionBackend, AttentionMetadata, write_kv

logger = logging.getLogger(__name__)

_NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@dataclass(frozen=True)
class _NativeStep:
    """One forward pass's batch layout for the native kernel, shared by all layers."""

    meta: AttentionMetadata
    key: tuple[object, ...]  # kv_layer layout, head counts, dtype, scale, threads
    params: cpu_native.AttnParams
    slots: torch.Tensor  # int64 cache slots of the step's new K/V
    keep: tuple[torch.Tensor, ...]  # tensors the params point into


@dataclass(frozen=True)
class _TorchStep:
    meta: AttentionMetadata
    decode_rows: torch.Tensor | None  # rows of the decodes (None: none, or every row)
    decode: ContextPlan | None


class CpuBackend(AttentionBackend):
    """Paged attention for CPUs; see the module docstring. One instance serves one forward
    pass at a time (its plans and workspace are per pass)."""

    name = "cpu"

    def __init__(self, native: bool = True) -> None:
        self._library = cpu_native.load() if native else None
        self._width = None if self._library is None else int(self._library.ragserve_vector_width())
        self._native_step: _NativeStep | None = None
        self._torch_step: _TorchStep | None = None
        self._workspace = GatherWorkspace()
        self._warned: set[str] = set()

    @property
    def is_native(self) -> bool:
        return self._library is not None

    def _native_reason(
        self, heads: int, dim: int, dtype: torch.dtype, kv_layer: torch.Tensor
    ) -> str | None:
        """Why the native kernel cannot attend ``heads`` query heads of ``dim`` in ``dtype``
        over ``kv_layer``, or None when it can."""
        if self._library is None or self._width is None:
            return "the native kernels are not built"
        group = heads // kv_layer.shape[3]
        if kv_layer.device.type != "cpu":
            return "not on the CPU"
        if dtype not in _NATIVE_DTYPES or kv_layer.dtype != dtype:
            return f"{dtype} queries over a {kv_layer.dtype} cache"
        if dim % (2 * self._width) or dim > 512 or group > 8 * self._width:
            return f"head_dim {dim} with {group} query heads per kv head"
        return None

    def native_layout(
        self,
        meta: AttentionMetadata,
        kv_layer: torch.Tensor,
        heads: int,
        dtype: torch.dtype,
        scale: float,
    ) -> tuple[cpu_native.AttnParams, torch.Tensor] | None:
        """The native kernel's layout of this step and its int64 cache slots, for callers
        that run the kernel themselves (``kernels/cpu_decoder_stack.py``); None where the
        native kernel cannot take it."""
        if self._native_reason(heads, kv_layer.shape[-1], dtype, kv_layer) is not None:
            return None
        step = self._step(meta, kv_layer, heads, dtype, scale)
        return step.params, step.slots

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        reason = self._native_reason(query.shape[1], query.shape[2], query.dtype, kv_layer)
        if reason is None:
            return self._native_forward(query, key, value, kv_layer, meta, scale, store=True)
        if reason not in self._warned:
            self._warned.add(reason)
            logger.info("CPU attention in pure torch: %s", reason)
        return self._torch_forward(query, key, value, kv_layer, meta, scale)

    # -- native --------------------------------------------------------------------------------
    def _step(
        self,
        meta: AttentionMetadata,
        kv_layer: torch.Tensor,
        heads: int,
        dtype: torch.dtype,
        scale: float,
    ) -> _NativeStep:
        threads = torch.get_num_threads()
        key = (*kv_layer.shape, *kv_layer.stride()[:2], heads, dtype, scale, threads)
        step = self._native_step
        if step is not None and step.meta is meta and step.key == key:
            return step
        query_start = meta.query_start_loc.to(torch.int32).contiguous()
        seq_lens = meta.seq_lens.to(torch.int32).contiguous()
        tables = meta.block_tables.to(torch.int32).contiguous()
        params = cpu_native.AttnParams(
            num_seqs=meta.num_seqs,
            num_heads=heads,
            num_kv_heads=kv_layer.shape[3],
            head_dim=kv_layer.shape[4],
            block_size=kv_layer.shape[2],
            is_bf16=_NATIVE_DTYPES[dtype],
            num_threads=threads,
            block_stride=kv_layer.stride(0),
            kv_offset=kv_layer.stride(1),
            table_stride=tables.stride(0) if tables.dim() == 2 else 0,
            query_start=query_start.data_ptr(),
            seq_lens=seq_lens.data_ptr(),
            block_tables=tables.data_ptr(),
            scale=scale,
        )
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        step = _NativeStep(meta, key, params, slots, (query_start, seq_lens, tables))
        self._native_step = step
        return step

    def _native_forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        store: bool,
    ) -> torch.Tensor:
        # NOTE: looked up per call, not the one held since start-up, so that a benchmark can
        # swap builds of the kernels between steps (ragserve/bench/builds.py).
        library = cpu_native.load()
        assert library is not None
        step = self._step(meta, kv_layer, query.shape[1], query.dtype, scale)
        q = _rows_contiguous(query)
        out = torch.empty(q.shape, dtype=q.dtype)
        key_ptr = value_ptr = None
        key_stride = value_stride = 0
        if store:
            assert key is not None and value is not None
            key, value = _rows_contiguous(key.to(q.dtype)), _rows_contiguous(value.to(q.dtype))
            key_ptr, value_ptr = key.data_ptr(), value.data_ptr()
            key_stride, value_stride = key.stride(0), value.stride(0)
        status = library.ragserve_paged_attention(
            ctypes.byref(step.params),
            q.data_ptr(),
            q.stride(0),
            key_ptr,
            key_stride,
            value_ptr,
            value_stride,
            step.slots.data_ptr(),
            kv_layer.data_ptr(),
            out.data_ptr(),
        )
        if status != 0:
            raise RuntimeError(
                f"native CPU attention failed with status {status} (-2: out of memory)"
            )
        return out

    # -- pure torch -----------------------------------------------------------------------------
    def _torch_forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(key, value, kv_layer, meta.slot_mapping)
        step = self._torch_step
        if step is None or step.meta is not meta:
            step = self._torch_step = _plan_torch(meta, kv_layer.shape[2], query.dtype)
        if step.decode is not None and step.decode_rows is None:
            return attend_decode_heads(query, kv_layer, step.decode, scale, self._workspace)
        output = torch.empty_like(query)
        start = 0
        for seq, (query_len, seq_len) in enumerate(
            zip(meta.query_lens_host, meta.seq_lens_host, strict=True)
        ):
            rows = slice(start, start + query_len)
            start += query_len
            if query_len == 1:
                continue
            context = seq_len - query_len
            if context == 0:
                output[rows] = causal_self_attention(query[rows], key[rows], value[rows], scale)
            else:
                output[rows] = prefill_attention_split(
                    query[rows],
                    key[rows],
                    value[rows],
                    kv_layer,
                    meta.block_tables[seq],
                    context,
                    scale,
                    self._workspace,
                )
        if step.decode is not None:
            assert step.decode_rows is not None
            output[step.decode_rows] = attend_decode_heads(
                query[step.decode_rows], kv_layer, step.decode, scale, self._workspace
            )
        return output


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, dim]`` with each token's heads contiguous (any token stride)."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def _plan_torch(meta: AttentionMetadata, block_size: int, dtype: torch.dtype) -> _TorchStep:
    decode_rows: list[int] = []
    decode_seqs: list[int] = []
    start = 0
    for seq, query_len in enumerate(meta.query_lens_host):
        if query_len == 1:
            decode_rows.append(start)
            decode_seqs.append(seq)
        start += query_len
    if not decode_seqs:
        return _TorchStep(meta, None, None)
    seq_lens = [meta.seq_lens_host[s] for s in decode_seqs]
    if len(decode_seqs) == meta.num_seqs:
        return _TorchStep(meta, None, plan_decode(meta.block_tables, seq_lens, block_size, dtype))
    tables = meta.block_tables[torch.tensor(decode_seqs)]
    rows = torch.tensor(decode_rows)
    return _TorchStep(meta, rows, plan_decode(tables, seq_lens, block_size, dtype))
