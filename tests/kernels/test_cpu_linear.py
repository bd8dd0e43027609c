"""CPU linears: prepacked bf16 weights and the native float32 products of a few rows (over
weights stored transposed) give the same numbers as ``F.linear``; paired bf16 products give
every row its decode bits at any row count, SiLU fused in or not; copies are made again
after every load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_native
from kernels.cpu_layer_ops import silu_and_mul
from kernels.cpu_linear import (
    AMX_LINEAR_MAX_ROWS,
    BF16_SMALL_LINEAR_MAX_ROWS,
    ENV_WIDE,
    PAIR_PANEL,
    PAIRS_LINEAR_MAX_ROWS,
    SMALL_LINEAR_MAX_ROWS,
    WIDE_MIN_ROWS,
    can_pack,
    fuses_silu_mul,
    pack_weight,
    packed_linear,
    pair_weight,
    pairs_apply,
    pairs_linear,
    pairs_silu_mul,
    small_linear,
    small_linear_usable,
    store_transposed,
    widens,
)
from ragserve.models.layers import Linear
from ragserve.models.llama import LlamaForCausalLM
from ragserve.models.loader import load_model
from tests.model_factory import make_tiny_model

needs_bf16_onednn = pytest.mark.skipif(
    not can_pack(torch.empty(1, 1, dtype=torch.bfloat16)),
    reason="this CPU's oneDNN has no native bfloat16",
)


@needs_bf16_onednn
@pytest.mark.parametrize("rows", [1, 5, 33, 200, 1536, 2100])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_is_bit_identical_to_linear(rows: int, with_bias: bool) -> None:
    # SmolLM2's qkv projection: real widths, where a decode-shaped packing rounded differently.
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(960, 576, generator=generator).to(torch.bfloat16)
    bias = torch.randn(960, generator=generator).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 576, generator=generator).to(torch.bfloat16)
    out = packed_linear(x, pack_weight(weight), bias)
    assert out.shape == (rows, 960) and out.dtype == torch.bfloat16
    assert torch.equal(out, F.linear(x, weight, bias))
    assert torch.equal(packed_linear(x.view(1, rows, 576), pack_weight(weight), bias)[0], out)


@needs_bf16_onednn
def test_a_bf16_layer_gives_every_chunk_length_the_same_numbers() -> None:
    """Chunks of ``WIDE_MIN_ROWS`` rows or more: float32's product rounded once where this
    CPU widens, else the paired product (each row the bits it has in a decode step) or
    oneDNN's (``F.linear``'s bits); fewer rows: the product of a few rows."""
    layer = Linear(576, 48, bias=True, device=torch.device("cpu"), dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(3)
    layer.weight.copy_(torch.randn(48, 576, generator=generator))
    layer.bias.copy_(torch.randn(48, generator=generator))  # type: ignore[union-attr]
    layer.pack_for_cpu()
    rows = torch.randn(2100, 576, generator=generator).to(torch.bfloat16)
    in_bf16 = F.linear(rows, layer.weight, layer.bias)
    if layer.pairs is not None:
        in_bf16 = torch.cat([layer(chunk) for chunk in rows.split(PAIRS_LINEAR_MAX_ROWS)])
    wide = F.linear(rows.float(), layer.weight.float(), layer.bias.float()).bfloat16()  # type: ignore[union-attr]
    long_chunks = wide if widens(layer.weight) else in_bf16
    for length in (2100, 1536, 200, WIDE_MIN_ROWS):
        assert torch.equal(layer(rows[:length]), long_chunks[:length])
    assert torch.equal(layer(rows[:7]), in_bf16[:7])


@pytest.mark.parametrize("forced", ["0", "1"])
def test_long_bf16_products_widen_where_asked_and_never_on_amx(forced: str) -> None:
    """``RAGSERVE_CPU_BF16_WIDE`` overrides the one-off timing; AMX always keeps bf16; only
    2-D bf16 weights widen."""
    env = {**os.environ, ENV_WIDE: forced}
    code = (
        "import torch; from kernels.cpu_linear import widens; "
        "w = torch.zeros(8, 64, dtype=torch.bfloat16); "
        "print(widens(w), widens(w.float()), widens(w[None]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == [str(forced == "1" and not cpu_native.amx()), "False", "False"]


@needs_bf16_onednn
def test_repacking_follows_a_changed_weight() -> None:
    layer = Linear(16, 8, bias=True, device=torch.device("cpu"), dtype=torch.bfloat16)
    x = torch.randn(4, 16).to(torch.bfloat16)
    for seed in (1, 2):
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(8, 16, generator=generator))
            layer.bias.copy_(torch.randn(8, generator=generator))  # type: ignore[union-attr]
        layer.pack_for_cpu()
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@needs_bf16_onednn
@pytest.mark.parametrize("arch", ["llama", "llama-tied"])
def test_loaded_bf16_model_keeps_one_copy_and_the_same_numbers(tmp_path: Path, arch: str) -> None:
    """load_weights pairs every projection and the LM head where the CPU pairs, else packs
    them; packed logits equal the plain path's, paired ones its float32 sums rounded once."""
    model = load_model(make_tiny_model(tmp_path, arch), device="cpu", dtype="bfloat16").model
    assert isinstance(model, LlamaForCausalLM)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    paired = pairs_apply(linears[0].weight)
    assert linears and all((m.pairs is not None) == paired for m in linears)
    assert all((m._packed is None) == paired for m in linears)
    assert (model.lm_head is None) == (arch == "llama-tied")
    head = model._paired_tied_head if paired else model._packed_tied_head
    assert (head is not None) == (arch == "llama-tied")
    hidden = torch.randn(40, model.shape.hidden_size).to(torch.bfloat16)
    logits = model.compute_logits(hidden)
    projected = [m(hidden[:, : m.in_features]) for m in linears if m.in_features == hidden.shape[1]]
    for m in linears:
        m._packed = m.pairs = None
    model._packed_tied_head = model._paired_tied_head = None
    plain = [m(hidden[:, : m.in_features]) for m in linears if m.in_features == hidden.shape[1]]
    if paired:
        torch.testing.assert_close(model.compute_logits(hidden), logits, rtol=2**-7, atol=1e-2)
        for a, b in zip(projected, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-2)
    else:
        assert torch.equal(logits, model.compute_logits(hidden))
        assert all(torch.equal(a, b) for a, b in zip(projected, plain, strict=True))


needs_native = pytest.mark.skipif(
    not small_linear_usable(torch.zeros(1, 64), store_transposed(torch.zeros(8, 64))),
    reason="native CPU kernels unavailable",
)


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 8, 9, 31, SMALL_LINEAR_MAX_ROWS])
@pytest.mark.parametrize("out_features", [1, 13, 96, 1000])
@pytest.mark.parametrize("in_features", [7, 192, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_linear_matches_linear_in_float32(
    rows: int, out_features: int, in_features: int, with_bias: bool
) -> None:
    """Streamed rows (up to 4) and tiles of every row count, panels full and partial (13,
    1000: not whole panels), any inner size (7, 200: steps of weight rows and a remainder)."""
    generator = torch.Generator().manual_seed(rows * out_features + in_features)
    weight = store_transposed(torch.randn(out_features, in_features, generator=generator))
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    x = torch.randn(rows, in_features, generator=generator)
    out = small_linear(x, weight, bias)
    expected = F.linear(x, weight, bias)
    assert out.shape == expected.shape and out.dtype == torch.float32
    # NOTE: another order of float32 additions than MKL's: equal to rounding, which grows
    # with the sum of the products' sizes.
    bound = 1e-6 * (x.abs() @ weight.abs().T + (0 if bias is None else bias.abs()))
    assert bool(((out - expected).abs() <= bound).all())


@needs_native
def test_a_rows_result_does_not_depend_on_the_rest_of_the_batch() -> None:
    """Streamed rows and tiles of any row count, first or later over a panel, add in the same
    order, so a decode step gives each sequence the same bits whatever else runs with it."""
    generator = torch.Generator().manual_seed(7)
    # 100: a partial panel; 580: steps of weight rows and a remainder
    weight = store_transposed(torch.randn(100, 580, generator=generator))
    bias = torch.randn(100, generator=generator)
    batch = torch.randn(SMALL_LINEAR_MAX_ROWS, 580, generator=generator)
    alone = torch.cat([small_linear(batch[i : i + 1], weight, bias) for i in range(len(batch))])
    for rows in (2, 4, 5, 7, 9, 32, SMALL_LINEAR_MAX_ROWS):
        assert torch.equal(small_linear(batch[:rows], weight, bias), alone[:rows]), rows


@needs_native
@pytest.mark.parametrize("arch", ["llama", "llama-tied"])
def test_loaded_float32_model_stores_weights_transposed(tmp_path: Path, arch: str) -> None:
    """Projections are loaded in place in the transposed layout; a tied LM head keeps a
    transposed copy for decode steps, and its logits match ``F.linear``'s row by row."""
    model = load_model(make_tiny_model(tmp_path, arch), device="cpu", dtype="float32").model
    assert isinstance(model, LlamaForCausalLM)
    assert all(m.weight.t().is_contiguous() for m in model.modules() if isinstance(m, Linear))
    assert (model._transposed_tied_head is not None) == (arch == "llama-tied")
    head = model.model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    hidden = torch.randn(5, model.shape.hidden_size)
    logits = model.compute_logits(hidden)
    torch.testing.assert_close(logits, F.linear(hidden, head), rtol=1e-5, atol=1e-5)
    alone = torch.cat([model.compute_logits(hidden[i : i + 1]) for i in range(5)])
    assert torch.equal(logits, alone)


@needs_native
def test_small_linear_takes_only_few_contiguous_float32_rows() -> None:
    plain = torch.randn(16, 64)
    weight = store_transposed(plain)
    assert torch.equal(weight, plain) and weight.t().is_contiguous()
    assert small_linear_usable(torch.randn(SMALL_LINEAR_MAX_ROWS, 64), weight)
    assert small_linear_usable(torch.randn(1, 60), store_transposed(torch.randn(16, 60)))
    # prefill chunks: MKL's blocked GEMM is as fast
    assert not small_linear_usable(torch.randn(SMALL_LINEAR_MAX_ROWS + 1, 64), weight)
    assert not small_linear_usable(torch.randn(64, 2).t()[:1], weight)  # strided rows
    assert not small_linear_usable(torch.randn(1, 64), plain)  # float32 weights: transposed
    assert not small_linear_usable(torch.randn(1, 64), weight[1:9])  # not the whole weight
    bf16 = plain.bfloat16()
    assert small_linear_usable(torch.randn(1, 64).bfloat16(), bf16) == cpu_native.bf16_dot()
    bf16_rows = AMX_LINEAR_MAX_ROWS if cpu_native.amx() else BF16_SMALL_LINEAR_MAX_ROWS
    assert small_linear_usable(torch.randn(bf16_rows, 64).bfloat16(), bf16) == cpu_native.bf16_dot()
    assert not small_linear_usable(torch.randn(bf16_rows + 1, 64).bfloat16(), bf16)
    if pairs_apply(bf16):  # more rows need the paired copy
        pairs = pair_weight(bf16)
        assert small_linear_usable(torch.randn(PAIRS_LINEAR_MAX_ROWS, 64).bfloat16(), bf16, pairs)
        rows = torch.randn(PAIRS_LINEAR_MAX_ROWS + 1, 64).bfloat16()
        assert not small_linear_usable(rows, bf16, pairs)
    assert not small_linear_usable(torch.randn(1, 48).bfloat16(), torch.randn(16, 48).bfloat16())
    assert not small_linear_usable(torch.randn(1, 64).half(), weight.half())


needs_amx = pytest.mark.skipif(not cpu_native.amx(), reason="no AMX on this CPU or build")
needs_pairs = pytest.mark.skipif(
    not pairs_apply(torch.empty(1, 32, dtype=torch.bfloat16)),
    reason="no AVX-512 BF16 build, or AMX takes these rows",
)


@pytest.mark.skipif(not cpu_native.bf16_dot(), reason="no AVX-512 BF16 build")
@pytest.mark.parametrize(
    "rows",
    [
        1,
        BF16_SMALL_LINEAR_MAX_ROWS,
        BF16_SMALL_LINEAR_MAX_ROWS + 1,
        9,  # a second tile of rows (csrc/cpu_pairs_linear.c)
        17,
        max(AMX_LINEAR_MAX_ROWS, PAIRS_LINEAR_MAX_ROWS),
    ],
)
@pytest.mark.parametrize("out_features", [1, 13, PAIR_PANEL, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_bf16_linear_is_the_float32_sum_rounded_once(
    rows: int, out_features: int, with_bias: bool
) -> None:
    """One or two rows stream the weights with pair products; more run on AMX tiles, or
    over the paired copy without AMX, with weights of any row count (13, 1000: a last block
    of fewer than 32 rows and a last panel of fewer than PAIR_PANEL outputs)."""
    generator = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(out_features, 576, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16() if with_bias else None
    x = torch.randn(rows, 576, generator=generator).bfloat16()
    pairs = pair_weight(weight) if pairs_apply(weight) else None
    assert small_linear_usable(x, weight, pairs)
    out = small_linear(x, weight, bias, pairs)
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert out.shape == exact.shape and out.dtype == torch.bfloat16
    # one rounding to bf16 (2^-8 relative) after float32 sums in another order
    magnitudes = x.double().abs() @ weight.double().abs().T
    bound = 2.0**-8 * exact.abs() + 1e-6 * magnitudes
    assert bool(((out.double() - exact).abs() <= bound).all())


@needs_amx
def test_amx_linear_rows_do_not_depend_on_their_batch() -> None:
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(200, 1536, generator=generator).bfloat16()
    x = torch.randn(AMX_LINEAR_MAX_ROWS, 1536, generator=generator).bfloat16()
    whole = small_linear(x, weight, None)
    for start, stop in ((0, 3), (5, 21), (29, AMX_LINEAR_MAX_ROWS)):
        assert torch.equal(small_linear(x[start:stop], weight, None), whole[start:stop])


@needs_pairs
def test_paired_weight_holds_each_outputs_pairs_panel_by_panel() -> None:
    weight = torch.randn(PAIR_PANEL + 5, 64).bfloat16()
    pairs = pair_weight(weight)
    assert pairs.dtype == torch.int32 and pairs.shape == (2, 32, PAIR_PANEL)
    # element [p, i, j]: the bf16 pair weight[p * PAIR_PANEL + j, 2i : 2i + 2], low half first
    halves = pairs.view(torch.bfloat16).view(2, 32, PAIR_PANEL, 2)
    for out, panel_j in ((0, (0, 0)), (7, (0, 7)), (PAIR_PANEL + 4, (1, 4))):
        p, j = panel_j
        assert torch.equal(halves[p, :, j].reshape(64), weight[out])
    assert not bool(halves[1, :, 5:].any())  # zero past the last output
    with pytest.raises(ValueError, match="cannot pair"):
        pair_weight(torch.randn(8, 64))


@needs_pairs
def test_paired_rows_do_not_depend_on_their_batch() -> None:
    """One row alone, two, or among 32: over the paired copy each gets the same bits (one or
    two rows do not take the streamed product when the weight is paired)."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(200, 1536, generator=generator).bfloat16()
    pairs = pair_weight(weight)
    x = torch.randn(PAIRS_LINEAR_MAX_ROWS, 1536, generator=generator).bfloat16()
    whole = small_linear(x, weight, None, pairs)
    for start, stop in ((0, 1), (3, 5), (0, 3), (5, 21), (29, PAIRS_LINEAR_MAX_ROWS)):
        assert torch.equal(small_linear(x[start:stop], weight, None, pairs), whole[start:stop])


@needs_pairs
@pytest.mark.parametrize("rows", [PAIRS_LINEAR_MAX_ROWS + 1, 47, 300, 2100])
@pytest.mark.parametrize("shape", [(100, 576), (PAIR_PANEL, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_paired_products_of_many_rows_give_each_row_its_decode_bits(
    rows: int, shape: tuple[int, int], with_bias: bool
) -> None:
    """Prefill chunks split by rows, in blocks (2,100 rows: several blocks a thread and a
    last partial tile; 100 outputs: a partial panel), take the same sums as decode steps."""
    n_out, k_in = shape
    generator = torch.Generator().manual_seed(rows + n_out)
    weight = torch.randn(n_out, k_in, generator=generator).bfloat16()
    bias = torch.randn(n_out, generator=generator).bfloat16() if with_bias else None
    x = torch.randn(rows, k_in, generator=generator).bfloat16()
    pairs = pair_weight(weight)
    out = pairs_linear(x, pairs, bias, n_out)
    chunks = [small_linear(c, weight, bias, pairs) for c in x.split(PAIRS_LINEAR_MAX_ROWS)]
    assert out.shape == (rows, n_out) and torch.equal(out, torch.cat(chunks))
    batched = pairs_linear(x.view(1, rows, k_in), pairs, bias, n_out)
    assert batched.shape == (1, rows, n_out) and torch.equal(batched[0], out)


@needs_pairs
@pytest.mark.parametrize("rows", [1, PAIRS_LINEAR_MAX_ROWS + 1, 300, 2100])
@pytest.mark.parametrize("intermediate_size", [PAIR_PANEL, 1536])
@pytest.mark.parametrize("with_bias", [False, True])
def test_silu_fused_into_the_gate_up_product_gives_the_separate_passes_bits(
    rows: int, intermediate_size: int, with_bias: bool
) -> None:
    generator = torch.Generator().manual_seed(rows + intermediate_size)
    weight = torch.randn(2 * intermediate_size, 576, generator=generator).bfloat16()
    weight *= 0.1  # activations of both signs and sizes, SiLU's curve and both its tails
    bias = torch.randn(2 * intermediate_size, generator=generator).bfloat16() if with_bias else None
    x = torch.randn(rows, 576, generator=generator).bfloat16()
    pairs = pair_weight(weight)
    separate = silu_and_mul(pairs_linear(x, pairs, bias, 2 * intermediate_size))
    fused = pairs_silu_mul(x, pairs, bias, intermediate_size)
    assert fused.shape == (rows, intermediate_size) and torch.equal(fused, separate)


@needs_pairs
def test_silu_is_fused_only_over_whole_panels() -> None:
    assert fuses_silu_mul(2 * PAIR_PANEL) and not fuses_silu_mul(PAIR_PANEL + 16)
    weight = torch.randn(2 * (PAIR_PANEL + 16), 64).bfloat16()
    with pytest.raises(ValueError, match="no fused SiLU"):
        pairs_silu_mul(torch.randn(40, 64).bfloat16(), pair_weight(weight), None, PAIR_PANEL + 16)
    layer = Linear(
        64, 2 * (PAIR_PANEL + 16), bias=False, device=torch.device("cpu"), dtype=torch.bfloat16
    )
    layer.weight.copy_(weight)
    layer.pack_for_cpu()
    assert layer.pairs_silu_mul(torch.randn(40, 64).bfloat16(), PAIR_PANEL + 16) is None
    assert (
        layer.pairs_silu_mul(torch.randn(PAIRS_LINEAR_MAX_ROWS, 64).bfloat16(), PAIR_PANEL) is None
    )


@needs_pairs
def test_a_bf16_layers_pairs_follow_its_weight() -> None:
    layer = Linear(64, 24, bias=True, device=torch.device("cpu"), dtype=torch.bfloat16)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    assert layer.pairs is None  # nothing is paired before pack_for_cpu
    layer.pack_for_cpu()
    x = torch.randn(5, 64).bfloat16()
    assert torch.equal(layer(x), small_linear(x, layer.weight, layer.bias, layer.pairs))
    layer.weight.data = torch.randn(24, 64).bfloat16()
    layer.pack_for_cpu()
    exact = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert torch.allclose(layer(x).double(), exact, rtol=2**-7, atol=1e-2)


@needs_pairs
def test_rows_past_two_without_the_right_pairs_are_refused() -> None:
    weight = torch.randn(50, 64).bfloat16()
    x = torch.randn(5, 64).bfloat16()
    with pytest.raises(ValueError, match="paired copy"):
        small_linear(x, weight, None)
    with pytest.raises(ValueError, match="paired copy"):  # another weight's pairs
        small_linear(x, weight, None, pair_weight(torch.randn(50, 96).bfloat16()))


@needs_pairs
@pytest.mark.parametrize("arch", ["llama", "llama-tied"])
def test_a_model_past_the_pairs_budget_keeps_no_pairs(
    tmp_path: Path, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its products of a few rows go to oneDNN instead, with the same numbers as any
    bf16 product rounded once."""
    model = load_model(make_tiny_model(tmp_path, arch), device="cpu", dtype="bfloat16").model
    assert isinstance(model, LlamaForCausalLM)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert all(m.pairs is not None for m in linears)
    assert (model._paired_tied_head is not None) == (arch == "llama-tied")
    hidden = torch.randn(5, model.shape.hidden_size).to(torch.bfloat16)
    paired = model.compute_logits(hidden)
    monkeypatch.setattr("ragserve.models.llama.PAIRS_MAX_BYTES", 0)
    model.pack_cpu_weights()
    assert all(m.pairs is None for m in linears) and model._paired_tied_head is None
    torch.testing.assert_close(model.compute_logits(hidden), paired, rtol=2**-7, atol=1e-2)


@needs_native
def test_linear_layer_matches_f_linear_on_both_paths() -> None:
    layer = Linear(64, 24, bias=True, device=torch.device("cpu"), dtype=torch.float32)
    assert layer.weight.t().is_contiguous()  # float32 CPU weights are stored transposed
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    for rows in (1, 9, SMALL_LINEAR_MAX_ROWS + 1):  # one tile, two, F.linear
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    layer.weight.data = torch.randn(24, 64)  # a plain layout, as whoever writes weights may
    layer.pack_for_cpu()
    assert layer.weight.t().is_contiguous()
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
