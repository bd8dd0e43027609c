"""The model's last layer computes outputs only for the rows that are sampled from.

A step's rows that no token is sampled after (the body of a prompt, a chunk that does not
end its prompt) need only their K/V stored in the last layer. ``ModelRunner.prepare``
names the sampled rows; the model with them must give those rows' hidden states as the
full computation does, and leave the KV cache bit for bit as the full computation does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.interface import AttentionBackend
from kernels.reference import ReferenceBackend
from ragserve.engine.model_runner import ModelRunner
from ragserve.engine.sequence import Sequence
from ragserve.models.forward_context import ForwardContext, forward_context
from ragserve.models.loader import load_model
from tests.model_factory import make_tiny_model
from tests.sequences import random_sequence

BLOCK_SIZE = 4
NUM_BLOCKS = 32


def _sequence(seq_id: int, num_tokens: int, first_block: int) -> Sequence:
    num_blocks = -(-(num_tokens + 1) // BLOCK_SIZE)  # room for one decoded token
    return random_sequence(seq_id, num_tokens, list(range(first_block, first_block + num_blocks)))


def _run_both_ways(
    runner: ModelRunner, seqs: list[Sequence], num_new: list[int]
) -> tuple[list[int] | None, int]:
    """One step both ways on copies of the cache; returns the sampled rows and the batch size."""
    input_ids, positions, meta, output_rows = runner.prepare(seqs, num_new)
    full_cache = runner.kv_cache.clone()
    with forward_context(ForwardContext(meta=meta, kv_cache=full_cache, backend=runner.backend)):
        full = runner.model(input_ids, positions)
    with forward_context(
        ForwardContext(meta=meta, kv_cache=runner.kv_cache, backend=runner.backend)
    ):
        pruned = runner.model(input_ids, positions, output_rows)

    assert torch.equal(runner.kv_cache, full_cache), "the last layer must store every row's K/V"
    if output_rows is None:
        assert torch.equal(pruned, full)
        rows = None
    else:
        rows = output_rows.indices.tolist()
        assert pruned.shape == (len(rows), full.shape[1])
        torch.testing.assert_close(pruned, full[rows], atol=1e-5, rtol=1e-5)
        if rows:
            logits = runner.model.compute_logits(pruned)
            assert torch.equal(
                logits.argmax(-1), runner.model.compute_logits(full[rows]).argmax(-1)
            )
    for seq, n in zip(seqs, num_new, strict=True):
        seq.num_computed_tokens += n
    return rows, len(input_ids)


def _backend(device: str) -> AttentionBackend:
    if device == "cpu":
        return ReferenceBackend()
    from kernels.triton_backend import TritonBackend

    return TritonBackend()


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.gpu),
    ],
)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_last_layer_computes_sampled_rows_only(tmp_path: Path, arch: str, device: str) -> None:
    model = load_model(make_tiny_model(tmp_path, arch), device=device).model
    kv_cache = torch.zeros(
        NUM_BLOCKS,
        model.num_layers,
        2,
        BLOCK_SIZE,
        model.num_kv_heads,
        model.head_dim,
        device=device,
    )
    runner = ModelRunner(model, kv_cache, _backend(device), BLOCK_SIZE, torch.device(device))
    whole, chunked, short, late = (
        _sequence(0, 11, 0),
        _sequence(1, 15, 3),
        _sequence(2, 8, 7),
        _sequence(3, 12, 10),
    )

    # A whole prompt (sampled), the first chunk of a prompt and a prompt's body (not).
    rows, size = _run_both_ways(runner, [whole, chunked, short], [11, 9, 7])
    assert (rows, size) == ([10], 27)

    # Nothing sampled: the last layer only stores K/V.
    rows, _ = _run_both_ways(runner, [late], [4])
    assert rows == []

    # A prompt's last chunk, its last single token, and a chunk after cached context:
    # the first two are sampled and attend over their whole contexts.
    rows, size = _run_both_ways(runner, [chunked, short, late], [6, 1, 8])
    assert (rows, size) == ([5, 6, 14], 15)

    # Only decodes: every row is sampled, so the model computes every row as before.
    for seq in (whole, chunked, short, late):
        seq.token_ids.append(5)
    rows, _ = _run_both_ways(runner, [whole, chunked, short, late], [1, 1, 1, 1])
    assert rows is None
