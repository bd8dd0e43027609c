"""Small CPU steps run the decoder layers in one native call, bit-identical to the
per-op path: the same hidden states and the same K/V written, for decode steps of one,
two and several sequences, and for a short question whose last layer computes one row."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import cpu_linear
from kernels.cpu_backend import CpuBackend
from ragserve.engine.model_runner import ModelRunner
from ragserve.engine.sequence import Sequence
from ragserve.models.forward_context import ForwardContext, forward_context
from ragserve.models.loader import load_model
from ragserve.models.native_layers import run_native_layers, shapes_fit
from tests.model_factory import make_tiny_model
from tests.sequences import random_sequence

BLOCK_SIZE = 16
NUM_BLOCKS = 64
# head_dim 32: the native products take inner sizes in multiples of 32
SHAPE = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}


def _sequence(seq_id: int, num_tokens: int, first_block: int) -> Sequence:
    return random_sequence(seq_id, num_tokens, list(range(first_block, first_block + 4)))


def _step_both_ways(runner: ModelRunner, seqs: list[Sequence], num_new: list[int]) -> bool:
    """Run one step natively and per op on copies of the cache; both must agree bit for
    bit. Returns whether the native layers took the step."""
    input_ids, positions, meta, output_rows = runner.prepare(seqs, num_new)
    model = runner.model.model
    per_op_cache = runner.kv_cache.clone()
    model.native_shapes = False
    with forward_context(ForwardContext(meta, per_op_cache, runner.backend)):
        per_op = runner.model(input_ids, positions, output_rows)
    model.native_shapes = True
    with forward_context(ForwardContext(meta, runner.kv_cache.clone(), runner.backend)):
        embeddings = model.embed_tokens(input_ids)
        took = run_native_layers(model, embeddings, model.rotary_emb(positions), output_rows)
    with forward_context(ForwardContext(meta, runner.kv_cache, runner.backend)):
        native = runner.model(input_ids, positions, output_rows)
    assert torch.equal(native, per_op)
    assert torch.equal(runner.kv_cache, per_op_cache)
    for seq, n in zip(seqs, num_new, strict=True):
        seq.num_computed_tokens += n
    if took is not None:
        assert took[2] == len(model.layers) - (output_rows is not None)
    return took is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "llama-bias"])
def test_native_layers_match_the_per_op_path(tmp_path: Path, arch: str, dtype: torch.dtype) -> None:
    most = cpu_linear.max_rows(dtype)
    if most == 0:
        pytest.skip(f"no native {dtype} products on this CPU (bf16: AVX-512 BF16)")
    model = load_model(make_tiny_model(tmp_path, arch, **SHAPE), dtype=dtype).model
    assert model.model.native_shapes
    shape = (NUM_BLOCKS, model.num_layers, 2, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
    kv_cache = torch.zeros(shape, dtype=dtype)
    runner = ModelRunner(model, kv_cache, CpuBackend(), BLOCK_SIZE, torch.device("cpu"))
    seqs = [_sequence(i, 40 + 3 * i, 4 * i) for i in range(6)]

    # Prompts of 285 rows take the per-op path (more rows than the native products).
    assert not _step_both_ways(runner, seqs, [seq.num_tokens for seq in seqs])
    for seq in seqs:
        seq.token_ids.append(7)
    # One decode, then two, then four sequences (bf16 four: AMX tiles, where the CPU has them).
    assert _step_both_ways(runner, seqs[:1], [1])
    seqs[0].token_ids.append(8)
    assert _step_both_ways(runner, seqs[:2], [1, 1])
    assert _step_both_ways(runner, seqs[2:], [1, 1, 1, 1]) == (most >= 4)
    # A short question on a cached document: only its last row is sampled, so the last
    # layer runs per op (one row) after the native layers.
    question = _sequence(9, 60, 40)
    question.num_computed_tokens = 48
    assert _step_both_ways(runner, [question], [12]) == (most >= 12)

    # The weight pointers are gathered once, and again after the weights are rewritten.
    gathered = model.model.native_weights
    assert gathered is not None and gathered.dtype == dtype
    model.pack_cpu_weights()
    assert model.model.native_weights is None


def test_shapes_that_cannot_take_the_native_layers() -> None:
    from ragserve.models.llama import ModelShape

    fits = ModelShape(2, 4, 2, 32, 128, 96, 128)
    assert shapes_fit(fits, qk_norm=False, quantization="none")
    assert not shapes_fit(fits, qk_norm=True, quantization="none")
    assert not shapes_fit(fits, qk_norm=False, quantization="fp8")
    assert not shapes_fit(ModelShape(2, 4, 2, 16, 64, 96, 128), qk_norm=False, quantization="none")
