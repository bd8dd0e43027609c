"""FP8 weights (``--quantization fp8``, ``ragserve/models/fp8_linear.py``) on the CPU's
reference path: which layers are quantized, what they weigh, dummy weights drawn in FP8,
and the engine end to end against the unquantized one.

A tiny random-weight llama (hidden 64, 2 layers, float32 weights)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from kernels.fp8_kv import FP8_DTYPE
from kernels.fp8_linear import (
    ACCUMULATION_TOLERANCE,
    WEIGHT_ONLY_MAX_ROWS,
    dequantize_rows,
    fp8_matmul_reference,
    product_magnitudes,
    quantize_rows,
)
from kernels.triton_fp8_gemv import fp8_gemv_reference
from ragserve import LLM, SamplingParams
from ragserve.bench.shapes import (
    LLAMA_3_1_70B,
    decode_weight_bytes,
    linear_params,
    write_shape_config,
)
from ragserve.models.fp8_linear import Fp8Linear, QuantizedRows
from ragserve.models.layers import Linear, RMSNorm
from ragserve.models.llama import (
    ArchFlags,
    LlamaMLP,
    ModelShape,
    _norm_into,
    shape_from_config,
)
from ragserve.models.loader import load_model
from tests.model_factory import make_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NEW = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("model"), "llama-bias"))


def test_decoder_projections_hold_fp8_and_the_rest_the_model_dtype(model_dir: str) -> None:
    plain = load_model(model_dir, device="cpu")
    fp8 = load_model(model_dir, device="cpu", quantization="fp8")
    assert (plain.quantization, fp8.quantization) == ("none", "fp8")
    assert plain.fingerprint != fp8.fingerprint
    projections = [m for m in fp8.model.modules() if isinstance(m, Fp8Linear)]
    assert len(projections) == 2 * 4  # qkv, o, gate_up, down per layer
    assert isinstance(fp8.model.lm_head, Linear)
    assert fp8.model.model.embed_tokens.weight.dtype == torch.float32
    plain_params = dict(plain.model.named_parameters())
    for name, module in fp8.model.named_modules():
        if not isinstance(module, Fp8Linear):
            continue
        assert module.weight.dtype == FP8_DTYPE
        assert module.weight_scale.shape == (module.out_features, 1)
        assert module.bias is not None and module.bias.dtype == torch.float32
        # Each packed shard was quantized by row, which is quantizing the packed matrix.
        original = plain_params[f"{name}.weight"]
        back = dequantize_rows(module.weight, module.weight_scale)
        assert ((back - original).abs() <= 2.0**-4 * original.abs() + 1e-9).all()
        torch.testing.assert_close(
            module.weight_scale,
            original.abs().amax(dim=1, keepdim=True) * (1 / 448),
            rtol=0,
            atol=0,
        )


def test_dummy_fp8_weights_are_drawn_per_projection_and_weigh_fp8_bytes() -> None:
    directory = write_shape_config("tiny-llama")
    plain = load_model(directory, device="cpu", load_format="dummy")
    fp8 = load_model(directory, device="cpu", load_format="dummy", quantization="fp8")
    shape = fp8.shape
    projections = [m for m in fp8.model.modules() if isinstance(m, Fp8Linear)]
    assert all(m.weight.float().abs().amax() == 448 for m in projections)
    # Row maxima of 64 to 128 draws of N(0, 0.02): 0.033 to 0.091 here.
    assert all(
        0.02 < 448 * m.weight_scale.min() < 448 * m.weight_scale.max() < 0.15 for m in projections
    )

    def weight_bytes(model: torch.nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in model.parameters())

    scales = sum(m.out_features for m in projections)
    saved = linear_params(shape) * (4 - 1) - 4 * scales  # float32 -> one byte plus a scale
    assert weight_bytes(plain.model) - weight_bytes(fp8.model) == saved
    # The decode floor reads FP8 bytes for the projections, the model dtype for the rest.
    head_and_norms = decode_weight_bytes(shape, 4) - 4 * linear_params(shape)
    assert decode_weight_bytes(shape, 4, "fp8") == (
        linear_params(shape) + 4 * scales + head_and_norms
    )


def test_llama_70b_in_fp8_fits_one_141_gb_gpu() -> None:
    """The bytes ``--model-shape llama-3.1-70b --quantization fp8`` puts on the device."""
    shape = shape_from_config(SimpleNamespace(**LLAMA_3_1_70B))
    fp8 = decode_weight_bytes(shape, 2, "fp8") + shape.vocab_size * shape.hidden_size * 2
    bf16 = decode_weight_bytes(shape, 2) + shape.vocab_size * shape.hidden_size * 2
    # 68.5 GB of codes and scales, 4.2 GB of bf16 embedding and LM head, 0.003 GB of norms:
    # 67.5 GiB, leaving a 139 GiB H200 about 60 GiB of KV; bf16 would leave under 8 GiB.
    assert 72.5e9 < fp8 < 73e9
    assert 141e9 < bf16 < 141.5e9


@pytest.fixture(scope="module")
def float_engine(model_dir: str) -> Iterator[LLM]:
    # NOTE: an explicit KV budget: on a GPU both engines live at once, and the default
    # (a share of free device memory) would leave the second one none.
    with LLM(model_dir, dtype="float32", kv_cache_gib=0.25) as llm:
        yield llm


@pytest.fixture(scope="module")
def fp8_engine(model_dir: str) -> Iterator[LLM]:
    with LLM(model_dir, dtype="float32", quantization="fp8", kv_cache_gib=0.25) as llm:
        yield llm


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_engine_reports_fp8_weights_and_salts_their_kv_apart(
    float_engine: LLM, fp8_engine: LLM
) -> None:
    plain, fp8 = float_engine.engine.info, fp8_engine.engine.info
    assert (plain.quantization, fp8.quantization) == ("none", "fp8")
    assert fp8.weight_bytes < plain.weight_bytes
    assert fp8.model_fingerprint != plain.model_fingerprint
    assert fp8_engine.engine.salt_for("") != float_engine.engine.salt_for("")


def test_fp8_greedy_outputs_agree_with_float_weights_on_most_tokens(
    float_engine: LLM, fp8_engine: LLM
) -> None:
    """Teacher-forced top-1 agreement along the float engine's own greedy output.

    Measured: 44 of 48 next tokens agree (91.7%). Random weights give flat logits whose
    near ties e4m3 rounding can flip; 85% still fails for a wrong scale or shard (random
    tokens agree on about 1 in 128).
    """
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (1, 9, 17, 40)]
    reference = generate(float_engine, prompts, NEW)
    forced = [p + ref[:k] for p, ref in zip(prompts, reference, strict=True) for k in range(NEW)]
    want = [ref[k] for ref in reference for k in range(NEW)]
    got = [t[0] for t in generate(fp8_engine, forced, 1)]
    agreement = sum(a == b for a, b in zip(got, want, strict=True)) / len(want)
    assert agreement >= 0.85, f"FP8 weights agree on {agreement:.1%} of next tokens"


def _sm89() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm89(), reason="torch._scaled_mm needs compute capability >= 8.9")
def test_fp8_engine_on_the_gpu_runs_scaled_mm_and_graphs_give_the_eager_outputs(
    model_dir: str,
) -> None:
    """bf16 on CUDA: every projection takes the CUDA path (the tiny model's dims are
    multiples of 16): prompts quantize and call ``_scaled_mm``, decode batches of up to 16
    rows the weight-only GEMV, replayed from CUDA graphs, and they give the eager tokens."""
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (1, 9, 17, 40)]
    outputs = {}
    for eager in (True, False):
        with LLM(
            model_dir,
            dtype="bfloat16",
            device="cuda",
            quantization="fp8",
            enforce_eager=eager,
            kv_cache_gib=0.05,
        ) as llm:
            model = llm.engine.loaded.model
            projections = [m for m in model.modules() if isinstance(m, Fp8Linear)]
            assert projections and all(m.use_scaled_mm for m in projections)
            outputs[eager] = generate(llm, prompts, NEW)
    assert outputs[True] == outputs[False]


@pytest.mark.gpu
@pytest.mark.skipif(not _sm89(), reason="torch._scaled_mm needs compute capability >= 8.9")
def test_inputs_quantized_by_the_fused_kernels_give_the_unfused_tokens(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused norm/SiLU + quantize kernels are bit for bit the unfused pair, so prompts
    and graph-replayed decode batches give the same greedy tokens without them."""
    generator = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (1, 9, 17, 40)]
    outputs = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(Fp8Linear, "wants_quantized_input", lambda self, rows: False)
        with LLM(
            model_dir, dtype="bfloat16", device="cuda", quantization="fp8", kv_cache_gib=0.05
        ) as llm:
            outputs.append(generate(llm, prompts, NEW))
    assert outputs[0] == outputs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not _sm89(), reason="FP8 kernels need compute capability >= 8.9")
@pytest.mark.parametrize("rows", [1, WEIGHT_ONLY_MAX_ROWS, WEIGHT_ONLY_MAX_ROWS + 1, 300])
def test_the_layer_takes_the_weight_only_path_for_few_rows_only(rows: int) -> None:
    """Up to the threshold the activation is not quantized (the weight-only reference),
    past it it is (the ``_scaled_mm`` reference); each output is near its own only."""
    device = torch.device("cuda")
    layer = Fp8Linear(512, 384, bias=True, device=device, dtype=torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(rows)
    layer.load("weight", torch.randn(384, 512, device=device, generator=generator), 0, 384)
    layer.bias.data.copy_(torch.randn(384, device=device, generator=generator))
    x = torch.randn(rows, 512, device=device, generator=generator).to(torch.bfloat16)
    got = layer(x.view(rows, 1, 512)).view(rows, 384).float()
    args = (x, layer.weight, layer.weight_scale, layer.bias)
    weight_only, quantized = fp8_gemv_reference(*args), fp8_matmul_reference(*args)
    want, other = (
        (weight_only, quantized) if rows <= WEIGHT_ONLY_MAX_ROWS else (quantized, weight_only)
    )
    # bf16 output rounding and the accumulation (fast FP8 past the threshold); the other
    # path is off by ~2^-5.
    magnitudes = product_magnitudes(
        x, layer.weight, layer.weight_scale, quantized=rows > WEIGHT_ONLY_MAX_ROWS
    )
    tolerance = 2.0**-7 * want.abs() + ACCUMULATION_TOLERANCE * magnitudes
    assert ((got - want).abs() <= tolerance).all()
    assert ((got - other).abs() > tolerance).any()


def _bf16_layer(in_features: int, out_features: int, seed: int) -> Fp8Linear:
    layer = Fp8Linear(in_features, out_features, bias=True, device=DEVICE, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(seed)
    layer.load(
        "weight", torch.randn(out_features, in_features, generator=generator), 0, out_features
    )
    assert layer.bias is not None
    layer.bias.data.copy_(torch.randn(out_features, generator=generator))
    return layer


@pytest.mark.parametrize("rows", [1, 5])
def test_quantized_rows_give_what_their_bf16_rows_give(rows: int) -> None:
    """On the reference path (the CPU) bit for bit; on the GPU above the GEMV's rows, where
    the bf16 rows would be quantized by the same arithmetic before the same ``_scaled_mm``."""
    layer = _bf16_layer(512, 384, seed=rows)
    if layer.use_scaled_mm and rows <= WEIGHT_ONLY_MAX_ROWS:
        pytest.skip("few rows take the weight-only GEMV, which quantizes no activation")
    generator = torch.Generator().manual_seed(rows + 1)
    x = torch.randn(rows, 512, generator=generator).to(torch.bfloat16).to(DEVICE)
    got = layer(QuantizedRows(*quantize_rows(x)))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 384)
    assert torch.equal(got, layer(x))


def test_the_layer_wants_quantized_input_on_scaled_mm_above_the_gemv_rows() -> None:
    layer = Fp8Linear(64, 32, bias=False, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert not layer.wants_quantized_input(1000)  # the CPU's reference quantizes itself
    layer.use_scaled_mm = True
    assert not layer.wants_quantized_input(WEIGHT_ONLY_MAX_ROWS)
    assert layer.wants_quantized_input(WEIGHT_ONLY_MAX_ROWS + 1)


@pytest.mark.parametrize("with_residual", [False, True])
def test_norms_and_the_mlp_hand_an_fp8_linear_its_input_quantized(
    monkeypatch: pytest.MonkeyPatch, with_residual: bool
) -> None:
    """The decoder's fused norm + quantize and SiLU + quantize feed an FP8 linear that wants
    its input quantized (forced on the CPU, where the kernels run interpreted), bit for bit
    the unfused kernels then the layer's own quantizer; other consumers get bf16 rows."""
    from kernels.fused_ops import rms_norm, silu_and_mul
    from kernels.triton_fp8_quant import quantize_rows_triton

    monkeypatch.setattr(
        Fp8Linear, "wants_quantized_input", lambda self, rows: rows > WEIGHT_ONLY_MAX_ROWS
    )
    generator = torch.Generator().manual_seed(7)
    hidden = torch.randn(5, 256, generator=generator).to(torch.bfloat16).to(DEVICE)
    residual = torch.randn(5, 256, generator=generator).to(torch.bfloat16).to(DEVICE)
    norm = RMSNorm(256, 1e-5, device=DEVICE, dtype=torch.bfloat16)
    norm.weight.data.copy_(torch.rand(256, generator=generator))
    consumer = _bf16_layer(256, 384, seed=3)
    want_residual = residual.clone() if with_residual else hidden
    want_codes, want_scales = quantize_rows_triton(
        rms_norm(hidden, norm.weight, norm.eps, want_residual if with_residual else None)
    )
    got_residual = residual.clone() if with_residual else None
    normed, summed = _norm_into(norm, hidden, got_residual, consumer)
    assert isinstance(normed, QuantizedRows)
    assert torch.equal(normed.scales, want_scales)
    assert torch.equal(normed.codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(summed, want_residual)
    assert not isinstance(_norm_into(norm, hidden[:2], None, consumer)[0], QuantizedRows)
    plain = Linear(256, 384, bias=False, device=DEVICE, dtype=torch.bfloat16)
    assert not isinstance(_norm_into(norm, hidden, None, plain)[0], QuantizedRows)

    shape = ModelShape(
        num_layers=1,
        num_heads=4,
        num_kv_heads=4,
        head_dim=64,
        hidden_size=256,
        intermediate_size=192,
        vocab_size=128,
    )
    mlp = LlamaMLP(shape, ArchFlags(), device=DEVICE, dtype=torch.bfloat16, quantization="fp8")
    for layer, seed in ((mlp.gate_up_proj, 4), (mlp.down_proj, 5)):
        assert isinstance(layer, Fp8Linear)
        fill = torch.Generator().manual_seed(seed)
        weight = torch.randn(layer.out_features, layer.in_features, generator=fill)
        layer.load("weight", weight, 0, layer.out_features)
    codes, scales = quantize_rows_triton(silu_and_mul(mlp.gate_up_proj(hidden)))
    assert torch.equal(mlp(hidden), mlp.down_proj(QuantizedRows(codes, scales)))
