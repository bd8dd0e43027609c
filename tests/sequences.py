"""Sequences for tests that drive ``ModelRunner`` step by step, without the scheduler."""

from __future__ import annotations

import torch

from kvstore.kv_cache_manager import KVAllocation
from ragserve.engine.sequence import Sequence
from ragserve.sampling_params import SamplingParams


def random_sequence(seq_id: int, num_tokens: int, block_table: list[int]) -> Sequence:
    """A prompt of ``num_tokens`` random ids (seeded by ``seq_id``) on ``block_table``."""
    generator = torch.Generator().manual_seed(seq_id)
    return Sequence(
        seq_id=seq_id,
        request_id=f"request-{seq_id}",
        index=0,
        token_ids=torch.randint(3, 120, (num_tokens,), generator=generator).tolist(),
        num_prompt_tokens=num_tokens,
        params=SamplingParams(max_tokens=1),
        kv=KVAllocation(salt=b"", block_table=block_table),
        detokenizer=None,
    )
