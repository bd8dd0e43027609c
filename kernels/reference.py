"""Pure-torch paged attention: the CPU path and the oracle the GPU kernels are tested against."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu_decode_attention import attend_decode_heads
from kernels.cpu_paged_attention import (
    ContextPlan,
    GatherWorkspace,
    attend,
    causal_self_attention,
    group_queries,
    plan_decode,
    plan_prefill,
    ungroup_output,
)
from kernels.fp8_kv import is_quantized_cache
from kernels.fp8_read_through import Fp8ReadThrough
from kernels.interface import AttentionBackend, AttentionMetadata, slot_rows


@dataclass(frozen=True)
class _PrefillChunk:
    rows: slice  # its query rows in the flat batch
    plan: ContextPlan | None  # None: nothing cached before, attend over the new K/V only


@dataclass(frozen=True)
class _StepPlan:
    """Everything about one forward pass that does not depend on the layer."""

    meta: AttentionMetadata
    layout: tuple[object, ...]  # kv_layer shape and block stride, query head count and dtype
    key_rows: torch.Tensor  # rows of ``slot_rows(kv_layer)`` the new keys go to
    value_rows: torch.Tensor
    prefills: list[_PrefillChunk]
    decode_rows: torch.Tensor | None  # None: every row is a decode (a pure decode step)
    decode: ContextPlan | None


class ReferenceBackend(AttentionBackend):
    """Loops over prefill chunks; batches all single-token decodes into one padded SDPA call
    (or, for long bf16 CPU contexts, per-sequence products: ``kernels/cpu_decode_attention.py``).

    The first layer of a forward pass plans it (KV write rows, block lists, masks); the other
    layers reuse the plan. Context K/V are gathered into a workspace this backend owns (see
    ``kernels/cpu_paged_attention.py``), so one instance serves one forward pass at a time.

    An 8-bit cache (e4m3 or int8 codes) is read through ``kernels/fp8_read_through.py``: the
    blocks a step reads are dequantized, and attention runs in the query's dtype.
    """

    name = "reference"
    supports_quantized_kv = True

    def __init__(self) -> None:
        self._workspace = GatherWorkspace()
        self._plan: _StepPlan | None = None
        self._fp8: Fp8ReadThrough | None = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if is_quantized_cache(kv_layer):
            if self._fp8 is None:
                self._fp8 = Fp8ReadThrough(self)
            return self._fp8.forward(query, key, value, kv_layer, meta, scale)
        plan = self._plan
        layout = (*kv_layer.shape, kv_layer.stride(0), query.shape[1], query.dtype)
        if plan is None or plan.meta is not meta or plan.layout != layout:
            plan = self._plan = self._make_plan(meta, layout, kv_layer, query)
        rows = slot_rows(kv_layer)
        width = rows.shape[1]
        rows.index_copy_(0, plan.key_rows, key.reshape(-1, width).to(kv_layer.dtype))
        rows.index_copy_(0, plan.value_rows, value.reshape(-1, width).to(kv_layer.dtype))

        kv_heads = kv_layer.shape[3]
        if plan.decode is not None and plan.decode_rows is None:
            return attend_decode_heads(query, kv_layer, plan.decode, scale, self._workspace)
        output = torch.empty_like(query)
        for chunk in plan.prefills:
            q = query[chunk.rows]
            if chunk.plan is None:
                output[chunk.rows] = causal_self_attention(
                    q, key[chunk.rows], value[chunk.rows], scale
                )
            else:
                out = attend(
                    group_queries(q, kv_heads)[None], kv_layer, chunk.plan, scale, self._workspace
                )
                output[chunk.rows] = ungroup_output(out[0], q.shape[0])
        if plan.decode is not None:
            assert plan.decode_rows is not None
            output[plan.decode_rows] = attend_decode_heads(
                query[plan.decode_rows], kv_layer, plan.decode, scale, self._workspace
            )
        return output

    @staticmethod
    def _make_plan(
        meta: AttentionMetadata,
        layout: tuple[object, ...],
        kv_layer: torch.Tensor,
        query: torch.Tensor,
    ) -> _StepPlan:
        block_size, kv_heads = kv_layer.shape[2], kv_layer.shape[3]
        group = query.shape[1] // kv_heads
        # Same arithmetic as interface.write_kv: the rows are equal for every layer's view.
        rows_per_block = kv_layer.stride(0) // (kv_heads * kv_layer.shape[4])
        blocks = torch.div(meta.slot_mapping, block_size, rounding_mode="floor")
        key_rows = blocks * rows_per_block + meta.slot_mapping % block_size

        prefills: list[_PrefillChunk] = []
        decode_rows: list[int] = []
        decode_seqs: list[int] = []
        start = 0
        for seq, (query_len, seq_len) in enumerate(
            zip(meta.query_lens_host, meta.seq_lens_host, strict=True)
        ):
            if query_len == 1:
                decode_rows.append(start)
                decode_seqs.append(seq)
            else:
                context = None
                if query_len != seq_len:
                    table = meta.block_tables[seq]
                    context = plan_prefill(
                        table, seq_len, query_len, group, block_size, query.dtype
                    )
                prefills.append(_PrefillChunk(slice(start, start + query_len), context))
            start += query_len

        decode = None
        rows_tensor = None
        if decode_seqs:
            seq_lens = [meta.seq_lens_host[s] for s in decode_seqs]
            if len(decode_seqs) == meta.num_seqs:
                tables = meta.block_tables
            else:
                device = meta.block_tables.device
                tables = meta.block_tables[torch.tensor(decode_seqs, device=device)]
                rows_tensor = torch.tensor(decode_rows, device=device)
            decode = plan_decode(tables, seq_lens, block_size, query.dtype)
        return _StepPlan(
            meta, layout, key_rows, key_rows + block_size, prefills, rows_tensor, decode
        )
