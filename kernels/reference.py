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
    blocks = block_table[: -(-seq_len // block_size)].long()
    # NOTE: gathering K and V separately makes each result contiguous, so the reshape is free.
    key = kv_layer[:, 0][blocks].reshape(-1, *kv_layer.shape[-2:])[:seq_len]
    value = kv_layer[:, 1][blocks].reshape(-1, *kv_layer.shape[-2:])[:seq_len]
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
                chunk = slice(start, start + query_len)
                output[chunk] = self._prefill(
                    query[chunk], key[chunk], value[chunk], kv_layer, meta.block_tables[seq], seq_len, scale
                )
            start += query_len
        if decode_rows:
            rows = torch.tensor(decode_rows, device=query.device)
            output[rows] = self._decode(query[rows], kv_layer, meta, decode_seqs, scale)
        return output

    @staticmethod
    def _prefill(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_layer: torch.Tensor,
        block_table: torch.Tensor,
        seq_len: int,
        scale: float,
    ) -> torch.Tensor:
        query_len = query.shape[0]
        q = query.transpose(0, 1)  # [H, q, D]
        group = q.shape[0] // key.shape[1]
        if query_len == seq_len:  # nothing cached before: attend over the new K/V directly
            k, v, mask = key, value, None
        else:
            k, v = gather_context(kv_layer, block_table, seq_len)
            mask = _causal_mask(query_len, seq_len, query.device)
        # NOTE: 4-D inputs and expanded K/V (not enable_gqa): anything else sends SDPA to its
        # unfused math path on the CPU, which materialises every score (6x slower at 4k).
        k = k.transpose(0, 1).to(q.dtype).repeat_interleave(group, dim=0)
        v = v.transpose(0, 1).to(q.dtype).repeat_interleave(group, dim=0)
        out = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None, scale=scale
        )
        return out[0].transpose(0, 1)

    @staticmethod
    def _decode(
        query: torch.Tensor,  # [n, H, D]
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        seqs: list[int],
        scale: float,
    ) -> torch.Tensor:
        block_size, kv_heads, head_dim = kv_layer.shape[2:]
        n, num_heads, _ = query.shape
        seq_lens = [meta.seq_lens_host[s] for s in seqs]
        max_blocks = -(-max(seq_lens) // block_size)
        index = torch.tensor(seqs, device=query.device)
        tables = meta.block_tables[index, :max_blocks].long()  # [n, nb]
        length = max_blocks * block_size
        key = kv_layer[:, 0][tables].view(n, length, kv_heads, head_dim).transpose(1, 2)
        value = kv_layer[:, 1][tables].view(n, length, kv_heads, head_dim).transpose(1, 2)
        lens = torch.tensor(seq_lens, device=query.device)
        mask = torch.arange(length, device=query.device)[None, :] < lens[:, None]
        # NOTE: a kv head's query heads become its "query rows", so GQA needs no K/V copies.
        group = num_heads // kv_heads
        q = query.view(n, kv_heads, group, head_dim)
        out = F.scaled_dot_product_attention(
            q, key.to(q.dtype), value.to(q.dtype), attn_mask=mask[:, None, None, :], scale=scale
        )
        return out.reshape(n, num_heads, head_dim)
