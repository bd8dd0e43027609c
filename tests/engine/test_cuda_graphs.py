"""Decode CUDA graphs: bucket choice everywhere; on a GPU, graphs give the eager outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ragserve import LLM, SamplingParams
from ragserve.engine.cuda_graphs import decode_buckets
from tests.model_factory import make_tiny_model


def test_buckets_cover_every_batch_size_up_to_the_largest() -> None:
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert decode_buckets(256)[-3:] == [224, 240, 256]
    with pytest.raises(ValueError, match="max_batch"):
        decode_buckets(0)


@pytest.mark.gpu
@pytest.mark.parametrize("num_prompts", [1, 3, 5, 17])  # exact and padded buckets
def test_graph_decode_matches_eager_decode(tmp_path: Path, num_prompts: int) -> None:
    directory = make_tiny_model(tmp_path, "llama")
    generator = torch.Generator().manual_seed(num_prompts)
    prompts = [
        torch.randint(3, 128, (int(n),), generator=generator).tolist()
        for n in torch.randint(1, 70, (num_prompts,), generator=generator)
    ]
    # Different output lengths, so the decode batch shrinks through several buckets.
    params = [
        SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True)
        for i in range(num_prompts)
    ]
    results = {}
    for eager in (True, False):
        llm = LLM(
            str(directory),
            device="cuda",
            dtype="float32",
            max_num_seqs=24,
            enforce_eager=eager,
            kv_cache_gib=0.25,
        )
        assert (llm.engine.runner.decode_graphs is None) == eager
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[eager] = [o.outputs[0].token_ids for o in outputs]
        assert llm.engine.block_pool.num_used == 0
        llm.close()
    assert results[False] == results[True]


def test_warm_up_batches_leave_no_trace(tmp_path: Path) -> None:
    """The start-up warm-up (run on CUDA) writes only into free blocks and changes no output."""
    directory = make_tiny_model(tmp_path, "llama")
    llm = LLM(str(directory), dtype="float32", max_num_batched_tokens=1024)
    prompts = [[5, 9, 11, 40, 7], list(range(3, 60))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    engine = llm.engine
    engine.reset_prefix_cache()
    engine.runner.warm_up(1024, engine.max_model_len, engine.num_kv_blocks)
    engine.block_pool.check_invariants()
    assert engine.block_pool.num_used == 0 and engine.block_pool.num_cached == 0
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert after == before
