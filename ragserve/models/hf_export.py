"""A model as other tools see it, without loading it: its shape, and a GGUF model as a plain
HF directory (config, float32 safetensors, tokenizer).

For engines that read only HF directories (vLLM in ``ragserve bench cpu``): the weights are
those ragserve itself loads from the GGUF (dequantized, rotary rows unpermuted), so both
engines compute with the same numbers.
"""

from __future__ import annotations

from pathlib import Path

from ragserve.models.default_model import default_model_path
from ragserve.models.gguf_loader import iter_gguf_weights, open_gguf, rope_frequency_factors
from ragserve.models.hf_config import read_hf_config
from ragserve.models.llama import ModelShape, shape_from_config
from ragserve.models.tokenizer import cache_root, load_gguf_tokenizer


def model_path(model: str | None) -> Path:
    """The model a config names (None: the embedded default)."""
    return Path(model) if model else default_model_path()


def model_shape(model: str | None) -> ModelShape:
    """The model's shape from its config alone (no weights loaded)."""
    path = model_path(model)
    if path.suffix == ".gguf":
        return shape_from_config(open_gguf(path).config)
    return shape_from_config(read_hf_config(path))


def hf_dir_for(model: str | None) -> Path:
    """An HF directory as is; a GGUF file exported once into the cache, keyed by its header
    digest (another file of the same name is another model)."""
    path = model_path(model)
    if path.is_dir():
        return path
    digest = open_gguf(path).header_digest
    return export_hf_dir(path, cache_root() / "hf" / f"{path.stem}-{digest[:16]}")


def export_hf_dir(gguf_path: Path, target: Path) -> Path:
    """Write ``target`` once (a finished directory is reused) and return it."""
    if (target / "config.json").is_file():
        return target
    from safetensors.torch import save_file

    checkpoint = open_gguf(gguf_path)
    if rope_frequency_factors(checkpoint) is not None:
        # NOTE: HF configs have no field for llama.cpp's per-frequency divisors.
        raise ValueError(f"{gguf_path} has rope_freqs, which an HF directory cannot carry")
    partial = target.with_name(target.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    weights = {name: tensor.contiguous() for name, tensor in iter_gguf_weights(checkpoint)}
    save_file(weights, str(partial / "model.safetensors"), metadata={"format": "pt"})
    config = checkpoint.config
    config.dtype = "float32"
    load_gguf_tokenizer(gguf_path, checkpoint.header_digest).save_pretrained(partial)
    # config.json last: its presence marks a finished directory.
    config.save_pretrained(partial)
    partial.rename(target)
    return target
