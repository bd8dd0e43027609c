"""Flattens a scheduled batch into model inputs, runs the model once, returns last-token logits."""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np
import torch

from kernels.interface import AttentionBackend, AttentionMetadata
from kvstore.kv_cache_manager import KVAllocation
from ragserve.engine.cuda_graphs import DecodeGraphs
from ragserve.engine.sequence import Sequence
from ragserve.models.forward_context import ForwardContext, OutputRows, forward_context
from ragserve.models.llama import LlamaForCausalLM
from ragserve.sampling_params import SamplingParams


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.decode_graphs: DecodeGraphs | None = None

    @torch.inference_mode()
    def warm_up(self, max_num_tokens: int, max_model_len: int, num_blocks: int) -> None:
        """Run a few throw-away mixed batches so every kind of kernel compiles now.

        Triton compiles a kernel at its first launch with each new set of compile-time
        parameters (prefill or decode tiles, split-K or not), about a second each, which
        would otherwise land on the first requests. The batches write only into blocks
        that are free (nothing is cached yet) and their outputs are dropped.
        """
        batches = [
            # (cached context, new tokens) per sequence: a decode, short prompts and a chunk
            # after context (Triton tiles, split-K), then a long prompt (fused SDPA)
            [(63, 1), (0, 128), (192, 64), (0, 512)],
            [(0, 500)] * 4,  # enough programs to run without split-K
        ]
        for shapes in batches:
            shapes = [(context, new) for context, new in shapes if context + new <= max_model_len]
            while shapes and sum(new for _, new in shapes) > max_num_tokens:
                shapes = shapes[:-1]
            blocks_needed = sum(-(-(context + new) // self.block_size) for context, new in shapes)
            if not shapes or blocks_needed > num_blocks:
                continue
            seqs, next_block = [], 0
            for index, (context, new) in enumerate(shapes):
                num_seq_blocks = -(-(context + new) // self.block_size)
                seq = Sequence(
                    seq_id=-1 - index,
                    request_id="warm-up",
                    index=0,
                    token_ids=[0] * (context + new),
                    num_prompt_tokens=context + new,
                    params=SamplingParams(max_tokens=1),
                    kv=KVAllocation(
                        salt=b"", block_table=list(range(next_block, next_block + num_seq_blocks))
                    ),
                    detokenizer=None,
                    num_computed_tokens=context,
                )
                next_block += num_seq_blocks
                seqs.append(seq)
            self.execute(seqs, [new for _, new in shapes])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def prepare_attention(self, max_num_tokens: int, max_context_len: int) -> None:
        """Let the attention backend prepare steps of up to ``max_num_tokens`` new tokens
        over up to ``max_context_len`` in all (see ``AttentionBackend.warm_up``)."""
        shape = self.model.shape
        self.backend.warm_up(
            (max_num_tokens, shape.num_heads, shape.head_dim),
            shape.num_kv_heads,
            max_context_len,
            self.model.dtype,  # NOTE: the activations', not an FP8 cache's
            self.device,
        )

    def capture_decode_graphs(self, max_batch: int, max_model_len: int) -> None:
        """Record CUDA graphs for pure-decode batches of up to ``max_batch`` sequences."""
        graphs = DecodeGraphs(
            self.model, self.kv_cache, self.backend, self.block_size, max_batch, max_model_len
        )
        graphs.capture()
        self.decode_graphs = graphs

    def prepare(
        self,
        seqs: Seq[Sequence],
        num_new_tokens: Seq[int],
        next_token_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, OutputRows | None]:
        """Input ids, positions, attention metadata, and the rows whose logits are needed
        (None: every row's).

        ``next_token_ids`` (see ``execute``) replaces the ids read from the sequences.
        """
        input_ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        query_start = [0]
        seq_lens: list[int] = []
        logit_seqs: list[int] = []
        for index, (seq, num_new) in enumerate(zip(seqs, num_new_tokens, strict=True)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            if next_token_ids is None:
                input_ids += seq.token_ids[start:end]
            pos = np.arange(start, end, dtype=np.int64)
            table = np.asarray(seq.kv.block_table, dtype=np.int64)
            positions.append(pos)
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            query_start.append(query_start[-1] + num_new)
            seq_lens.append(end)
            if end >= seq.num_tokens:  # all known tokens computed: the next one is sampled
                logit_seqs.append(index)

        max_blocks = max(len(seq.kv.block_table) for seq in seqs)
        tables = np.zeros((len(seqs), max_blocks), dtype=np.int32)
        for row, seq in enumerate(seqs):
            tables[row, : len(seq.kv.block_table)] = seq.kv.block_table

        def to_device(array: np.ndarray | list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(np.asarray(array), dtype=dtype).to(
                self.device, non_blocking=True
            )

        def attention_metadata(
            slot_mapping: np.ndarray, query_lens: list[int], seq_lens: list[int], tables: np.ndarray
        ) -> AttentionMetadata:
            return AttentionMetadata(
                slot_mapping=to_device(slot_mapping, torch.int64),
                query_start_loc=to_device(np.cumsum([0, *query_lens]), torch.int32),
                seq_lens=to_device(seq_lens, torch.int32),
                block_tables=to_device(tables, torch.int32),
                query_lens_host=query_lens,
                seq_lens_host=seq_lens,
                max_query_len=max(query_lens, default=0),
                max_seq_len=max(seq_lens, default=0),
            )

        slot_mapping = np.concatenate(slots)
        meta = attention_metadata(slot_mapping, list(num_new_tokens), seq_lens, tables)
        output_rows = None
        if len(logit_seqs) < query_start[-1]:
            rows = np.asarray([query_start[i + 1] - 1 for i in logit_seqs], dtype=np.int64)
            output_rows = OutputRows(
                indices=to_device(rows, torch.int64),
                meta=attention_metadata(
                    slot_mapping[rows],
                    [1] * len(logit_seqs),
                    [seq_lens[i] for i in logit_seqs],
                    tables[logit_seqs],
                ),
            )
        return (
            to_device(input_ids, torch.int64) if next_token_ids is None else next_token_ids,
            to_device(np.concatenate(positions), torch.int64),
            meta,
            output_rows,
        )

    @torch.inference_mode()
    def execute(
        self,
        seqs: Seq[Sequence],
        num_new_tokens: Seq[int],
        next_token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ([rows, vocab], float32) of the sequences whose known tokens are all computed.

        ``next_token_ids`` ([len(seqs)] on the device) runs a step ahead of the host: one
        new token per sequence, at position ``num_computed_tokens``, whose id was sampled
        on the device and is not in ``token_ids`` yet. Every row's logits are returned.
        """
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(seqs, num_new_tokens):
            hidden = graphs.run(seqs, next_token_ids)
            if next_token_ids is not None:
                return self.model.compute_logits(hidden)
            sampled = [
                i for i, seq in enumerate(seqs) if seq.num_computed_tokens + 1 == seq.num_tokens
            ]
            if len(sampled) < len(seqs):  # a one-token prefill chunk samples nothing yet
                hidden = hidden[torch.tensor(sampled, device=hidden.device, dtype=torch.int64)]
            return self.model.compute_logits(hidden)
        input_ids, positions, meta, output_rows = self.prepare(seqs, num_new_tokens, next_token_ids)
        context = ForwardContext(meta=meta, kv_cache=self.kv_cache, backend=self.backend)
        with forward_context(context):
            hidden = self.model(input_ids, positions, output_rows)
        if hidden.shape[0] == 0:
            return hidden.new_empty((0, 0), dtype=torch.float32)
        return self.model.compute_logits(hidden)
