"""Pure-torch paged attention: the CPU path and the oracle the GPU kernels are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.interface import AttentionBackend, AttentionMetadata, write_kv


def gather_context(
    kv_layer: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence's first ``seq_len`` tokens, each ``[seq_len, kv_heads, head_dim]``."""
    block_size = kv_layer.shape[2]
    num_blocks = -(-seq_len // block_size)
    blocks = kv_layer[block_table[:num_blocks].long()]  # [nb, 2, bs, H, D]
    key = blocks[:, 0].reshape(-1, *blocks.shape[-2:])[:seq_len]
    value = blocks[:, 1].reshape(-1, *blocks.shape[-2:])[:seq_len]
    return key, value


def _causal_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """Bottom-right aligned causal mask: query i sits at position seq_len - query_len + i."""
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    key_pos = torch.arange(seq_len, device=device)[None, :]
    return key_pos <= query_pos


class ReferenceBackend(AttentionBackend):
    """Loops over prefill chunks; batches all single-token decodes into one padded SDPA call."""

    name = "reference"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(key, value, kv_layer, meta.slot_mapping)
        output = torch.empty_like(query)
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
                output[start : start + query_len] = self._prefill(
                    query[start : start + query_len], kv_layer, meta.block_tables[seq], seq_len, scale
                )
            start += query_len
        if decode_rows:
            rows = torch.tensor(decode_rows, device=query.device)
            output[rows] = self._decode(query[rows], kv_layer, meta, decode_seqs, scale)
        return output

    @staticmethod
    def _prefill(
        query: torch.Tensor, kv_layer: torch.Tensor, block_table: torch.Tensor, seq_len: int, scale: float
    ) -> torch.Tensor:
        query_len = query.shape[0]
        key, value = gather_context(kv_layer, block_table, seq_len)
        q = query.transpose(0, 1)  # [H, q, D]
        k = key.transpose(0, 1).to(q.dtype)
        v = value.transpose(0, 1).to(q.dtype)
        if query_len == seq_len:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            mask = _causal_mask(query_len, seq_len, query.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return out.transpose(0, 1)

    @staticmethod
    def _decode(
        query: torch.Tensor,  # [n, H, D]
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        seqs: list[int],
        scale: float,
    ) -> torch.Tensor:
        block_size = kv_layer.shape[2]
        seq_lens = [meta.seq_lens_host[s] for s in seqs]
        max_blocks = -(-max(seq_lens) // block_size)
        index = torch.tensor(seqs, device=query.device)
        tables = meta.block_tables[index, :max_blocks].long()  # [n, nb]
        blocks = kv_layer[tables]  # [n, nb, 2, bs, H, D]
        n = len(seqs)
        key = blocks[:, :, 0].reshape(n, max_blocks * block_size, *blocks.shape[-2:])
        value = blocks[:, :, 1].reshape(n, max_blocks * block_size, *blocks.shape[-2:])
        lens = torch.tensor(seq_lens, device=query.device)
        mask = torch.arange(max_blocks * block_size, device=query.device)[None, :] < lens[:, None]
        q = query.unsqueeze(2)  # [n, H, 1, D]
        k = key.transpose(1, 2).to(q.dtype)
        v = value.transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )
        return out.squeeze(2)
