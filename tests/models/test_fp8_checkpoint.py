"""Checkpoints stored in FP8 (``quantization_config.quant_method: "fp8"``): per-tensor and
per-channel weight scales, packed shards, ignored static input scales, and the layouts that
are refused. A tiny random llama, its projections quantized here as FP8 exporters do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.fp8_kv import FP8_DTYPE
from kernels.fp8_linear import dequantize_rows
from ragserve.models.fp8_linear import Fp8Linear
from ragserve.models.loader import load_model
from tests.model_factory import make_tiny_model
from tests.models.test_models import PagedBatch, random_sequences

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# How each projection stores its scale: exporters write all of these.
SCALE_SHAPES = {
    "q_proj": (),  # per tensor, a 0-d scalar
    "k_proj": (),
    "v_proj": (1,),  # per tensor, one element
    "o_proj": (),
    "gate_proj": ("rows",),  # per channel, [N]
    "up_proj": ("rows", 1),  # per channel, [N, 1]
    "down_proj": ("rows", 1),
}


def power_of_two_scale(amax: torch.Tensor) -> torch.Tensor:
    """A scale of the form 2^k covering ``amax``: codes times it, and 448 times it, are
    exact in float32, which makes the round trip below exact."""
    return torch.exp2(torch.ceil(torch.log2(amax / 448)))


def quantize_projection(
    weight: torch.Tensor, scale_shape: tuple
) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and a scale of ``scale_shape``; every row gets one code of +-448, so a
    per-row quantizer given ``codes * scale`` finds the same codes and scales again."""
    per_channel = bool(scale_shape)
    if per_channel and scale_shape[0] == "rows":
        amax = weight.abs().amax(dim=1, keepdim=True)
    else:
        amax = weight.abs().amax().expand(weight.shape[0], 1)
    scale = power_of_two_scale(amax)
    codes = (weight / scale).clamp(-448, 448)
    peak = codes.abs().argmax(dim=1)
    rows = torch.arange(weight.shape[0])
    codes[rows, peak] = 448 * torch.sign(codes[rows, peak])
    codes = codes.to(FP8_DTYPE)
    if scale_shape == ():
        stored = scale[0, 0].clone()
    elif scale_shape == (1,):
        stored = scale[0].clone()
    elif scale_shape == ("rows",):
        stored = scale[:, 0].clone()
    else:
        stored = scale.clone()
    return codes, stored


def write_checkpoints(source: Path, root: Path) -> tuple[Path, Path]:
    """``(fp8 checkpoint, the same weights dequantized to float32)`` next to each other."""
    tensors = load_file(str(source / "model.safetensors"))
    fp8: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module, _, kind = name.rpartition(".")
        projection = module.rsplit(".", 1)[-1]
        if kind != "weight" or projection not in PROJECTIONS:
            fp8[name] = dequantized[name] = tensor
            continue
        codes, scale = quantize_projection(tensor, SCALE_SHAPES[projection])
        fp8[name] = codes
        fp8[f"{module}.weight_scale"] = scale
        fp8[f"{module}.input_scale"] = torch.tensor(0.5)  # static: ignored on load
        if projection in ("k_proj", "v_proj"):  # an FP8 KV cache's scales: ignored too
            attention = module.rsplit(".", 1)[0]
            fp8[f"{attention}.{projection[0]}_scale"] = torch.tensor(0.25)
        dequantized[name] = codes.float() * scale.reshape(-1, 1)
    config = json.loads((source / "config.json").read_text())
    paths = []
    for kind, weights, extra in (
        (
            "fp8",
            fp8,
            {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}},
        ),
        ("dequantized", dequantized, {}),
    ):
        directory = root / kind
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config | extra))
        save_file(weights, str(directory / "model.safetensors"))
        paths.append(directory)
    return paths[0], paths[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8")
    return write_checkpoints(make_tiny_model(root, "llama-bias"), root)


def logits(directory: Path, **options: str) -> list[torch.Tensor]:
    """Logits of every position of three prompts, prefilled at once on the CPU."""
    model = load_model(directory, device="cpu", **options).model
    sequences = random_sequences([13, 7, 20], seed=4)
    return PagedBatch(model, len(sequences), 20).step(sequences)


def test_fp8_checkpoint_loads_its_codes_and_scales_as_they_are(
    checkpoints: tuple[Path, Path],
) -> None:
    """Dequantized, the served weights equal the checkpoint's dequantized weights exactly,
    per-tensor scales of q/k/v and gate/up parts broadcast into per-channel ones."""
    fp8_dir, dequantized_dir = checkpoints
    loaded = load_model(fp8_dir, device="cpu")  # no --quantization: the checkpoint decides
    assert loaded.quantization == "fp8"
    want = load_model(dequantized_dir, device="cpu").model  # float32, unquantized
    params = dict(want.named_parameters())
    for name, module in loaded.model.named_modules():
        if isinstance(module, Fp8Linear):
            served = dequantize_rows(module.weight, module.weight_scale)
            torch.testing.assert_close(served, params[f"{name}.weight"], rtol=0, atol=0)
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj.weight_scale
    assert qkv[:64].unique().numel() == 1 and qkv[64:96].unique().numel() == 1


def test_fp8_checkpoint_logits_equal_those_of_its_float_twin_quantized_on_load(
    checkpoints: tuple[Path, Path],
) -> None:
    """Exact: every row of the checkpoint has a +-448 code and a power-of-two scale, so
    quantizing its float32 twin on load yields the same codes and scales bit for bit, and
    the two models run the same arithmetic. Against the twin unquantized, only the per-token
    activation rounding remains: measured max |diff| 0.14 of logits up to 2.4, argmax equal
    at 35 of 40 positions (flat random logits; unrelated ones agree at about 1 in 128)."""
    fp8_dir, dequantized_dir = checkpoints
    served = logits(fp8_dir)
    twin = logits(dequantized_dir, quantization="fp8")
    for ours, theirs in zip(served, twin, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    unquantized = logits(dequantized_dir)
    rows = torch.cat(served)
    exact = torch.cat(unquantized)
    assert (rows - exact).abs().max() < 0.1 * exact.abs().max()
    assert (rows.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.8


def rewrite_config(directory: Path, quantization_config: dict) -> None:
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128]},
            r"block-wise FP8 checkpoints \(weight_block_size \[128, 128\]\) are not supported",
        ),
        ({"quant_method": "awq"}, "checkpoint quantization 'awq' is not supported"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "FP8 checkpoint format 'e5m2'"),
    ],
)
def test_unsupported_quantized_layouts_are_refused_in_one_line(
    tmp_path: Path, quantization_config: dict, message: str
) -> None:
    directory = make_tiny_model(tmp_path, "llama")
    rewrite_config(directory, quantization_config)
    with pytest.raises(ValueError, match=message) as caught:
        load_model(directory, device="cpu", load_format="dummy")
    assert "\n" not in str(caught.value)


def test_an_fp8_tensor_outside_the_projections_is_refused(tmp_path: Path) -> None:
    directory = make_tiny_model(tmp_path, "llama")
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"].to(FP8_DTYPE)
    save_file(tensors, str(directory / "model.safetensors"))
    rewrite_config(directory, {"quant_method": "fp8", "activation_scheme": "dynamic"})
    with pytest.raises(ValueError, match=r"'lm_head\.weight' is stored in FP8"):
        load_model(directory, device="cpu")


def test_a_missing_weight_scale_is_named(tmp_path: Path, checkpoints: tuple[Path, Path]) -> None:
    fp8_dir, _ = checkpoints
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    directory = tmp_path / "partial"
    directory.mkdir()
    (directory / "config.json").write_text((fp8_dir / "config.json").read_text())
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight_scale"):
        load_model(directory, device="cpu")
