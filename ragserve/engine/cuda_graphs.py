"""CUDA graphs of the model's forward pass for pure-decode batches.

An eager decode step of an 8B model launches about 20 kernels per layer, each paying
Python and launch overhead that dwarfs the few microseconds of GPU work behind it. A
graph records the whole forward once per *bucket* (a batch size) and replays it with one
launch. Graphs replay fixed addresses and fixed grids, so:

- inputs live in static buffers sized for the largest bucket; a step copies its values
  into the first rows and pads the rest of its bucket;
- padding rows are harmless: their slot is -1 (the KV write skips it), their context is
  one token of block 0 (read, never written), and their outputs are dropped;
- the attention grid and split-K degree are frozen at capture, chosen for the longest
  context a graph will serve (``max_model_len``); the kernel divides each sequence's
  real context among those splits at run time, so results are exact at any length.

Buckets are captured largest first into one memory pool, which the smaller graphs
reuse, so all of them together cost about as much memory as the largest one.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence as Seq

import torch

from kernels.interface import AttentionBackend, AttentionMetadata
from ragserve.engine.sequence import Sequence
from ragserve.models.forward_context import ForwardContext, forward_context
from ragserve.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def decode_buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every multiple of 16 up to ``max_batch``."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [size for size in (1, 2, 4, 8) if size <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """One captured forward per decode bucket, replayed with the step's inputs copied in."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        block_size: int,
        max_batch: int,
        max_model_len: int,
    ) -> None:
        if kv_cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA KV cache, got {kv_cache.device}")
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = decode_buckets(max_batch)
        device = kv_cache.device
        largest = self.buckets[-1]
        max_blocks = -(-max_model_len // block_size)
        self._input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self._positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self._slots = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self._seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self._query_start = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self._block_tables = torch.zeros((largest, max_blocks), dtype=torch.int32, device=device)
        # NOTE: one pinned staging buffer per input, so each step's copies are asynchronous.
        self._host_ids = torch.zeros(largest, dtype=torch.int64).pin_memory()
        self._host_positions = torch.zeros(largest, dtype=torch.int64).pin_memory()
        self._host_slots = torch.zeros(largest, dtype=torch.int64).pin_memory()
        self._host_seq_lens = torch.zeros(largest, dtype=torch.int32).pin_memory()
        self._host_tables = torch.zeros((largest, max_blocks), dtype=torch.int32).pin_memory()
        self._staging_free = torch.cuda.Event()
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def _meta(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self._slots[:batch],
            query_start_loc=self._query_start[: batch + 1],
            seq_lens=self._seq_lens[:batch],
            block_tables=self._block_tables[:batch],
            query_lens_host=[1] * batch,
            # NOTE: only sizes the split-K grid; the longest context any replay may see.
            seq_lens_host=[self.max_model_len] * batch,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    def _forward(self, batch: int) -> torch.Tensor:
        context = ForwardContext(
            meta=self._meta(batch), kv_cache=self.kv_cache, backend=self.backend
        )
        with forward_context(context):
            return self.model(self._input_ids[:batch], self._positions[:batch])

    @torch.inference_mode()
    def capture(self) -> None:
        """Record every bucket (largest first, one shared pool). Padding inputs throughout."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.kv_cache.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for batch in reversed(self.buckets):
                self._forward(batch)  # compile kernels and settle the allocator first
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._outputs[batch] = self._forward(batch)
                self._graphs[batch] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize(self.kv_cache.device)
        logger.info(
            "captured %d decode CUDA graphs (batch %d..%d) in %.1fs",
            len(self.buckets),
            self.buckets[0],
            self.buckets[-1],
            time.perf_counter() - started,
        )

    def bucket_for(self, batch: int) -> int | None:
        """The smallest captured bucket holding ``batch`` sequences, or None if too large."""
        index = bisect.bisect_left(self.buckets, batch)
        return self.buckets[index] if index < len(self.buckets) else None

    def can_run(self, seqs: Seq[Sequence], num_new_tokens: Seq[int]) -> bool:
        """A pure-decode batch that fits a bucket and stays within ``max_model_len``."""
        return (
            bool(self._graphs)
            and self.bucket_for(len(seqs)) is not None
            and all(n == 1 for n in num_new_tokens)
            and all(seq.num_computed_tokens < self.max_model_len for seq in seqs)
        )

    @torch.inference_mode()
    def run(self, seqs: Seq[Sequence], next_token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states ``[len(seqs), hidden]`` of one decode token per sequence.

        ``next_token_ids`` (on the device) supplies ids not yet on the host, as in
        ``ModelRunner.execute``.
        """
        batch = len(seqs)
        bucket = self.bucket_for(batch)
        assert bucket is not None and bucket in self._graphs
        self._staging_free.synchronize()  # the previous step's copies have left the buffers
        ids = self._host_ids.numpy()
        positions = self._host_positions.numpy()
        slots = self._host_slots.numpy()
        seq_lens = self._host_seq_lens.numpy()
        tables = self._host_tables.numpy()
        width = 1
        for row, seq in enumerate(seqs):
            pos = seq.num_computed_tokens
            table = seq.kv.block_table
            if next_token_ids is None:
                ids[row] = seq.token_ids[pos]
            positions[row] = pos
            slots[row] = table[pos // self.block_size] * self.block_size + pos % self.block_size
            seq_lens[row] = pos + 1
            tables[row, : len(table)] = table
            width = max(width, len(table))
        ids[batch:bucket] = 0
        positions[batch:bucket] = 0
        slots[batch:bucket] = -1
        seq_lens[batch:bucket] = 1
        tables[batch:bucket, 0] = 0
        self._input_ids[:bucket].copy_(self._host_ids[:bucket], non_blocking=True)
        self._positions[:bucket].copy_(self._host_positions[:bucket], non_blocking=True)
        self._slots[:bucket].copy_(self._host_slots[:bucket], non_blocking=True)
        self._seq_lens[:bucket].copy_(self._host_seq_lens[:bucket], non_blocking=True)
        self._block_tables[:bucket, :width].copy_(
            self._host_tables[:bucket, :width], non_blocking=True
        )
        self._staging_free.record()
        if next_token_ids is not None:
            self._input_ids[:batch].copy_(next_token_ids)
        self._graphs[bucket].replay()
        return self._outputs[bucket][:batch]
