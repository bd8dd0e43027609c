"""Which weight quantization an HF checkpoint asks for, from its ``quantization_config``.

Supported: ``quant_method: "fp8"`` with e4m3 weights and a per-tensor or per-channel
``weight_scale`` per linear (the layout most FP8 checkpoints on the hub use). A checkpoint
in FP8 is served in FP8 whatever ``--quantization`` says: its float weights do not exist.
Everything else that is quantized (block-wise FP8 scales, other methods) is refused with
one line saying what was found.
"""

from __future__ import annotations

from typing import Any


def checkpoint_quantization(config: Any) -> str | None:
    """``"fp8"`` for a supported FP8 checkpoint, None for an unquantized one.

    ValueError for a quantized layout ragserve does not read.
    """
    spec = getattr(config, "quantization_config", None)
    if spec is None:
        return None
    if not isinstance(spec, dict):
        spec = spec.to_dict()
    method = spec.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"checkpoint quantization {method!r} is not supported (only quant_method 'fp8' with "
            "per-tensor or per-channel weight scales)"
        )
    if spec.get("weight_block_size"):
        raise ValueError(
            f"block-wise FP8 checkpoints (weight_block_size {spec['weight_block_size']}) are not "
            "supported: only per-tensor or per-channel weight scales"
        )
    fmt = spec.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"FP8 checkpoint format {fmt!r} is not supported (only e4m3)")
    return "fp8"


def resolve_quantization(requested: str, config: Any) -> str:
    """The quantization to serve with: the checkpoint's when it has one, else ``requested``."""
    stored = checkpoint_quantization(config)
    return stored if stored is not None else requested
