"""Builds a ready-to-serve model from an HF directory, a GGUF file, or random ("dummy") weights.

``load_model`` resolves device and dtype, reads the config, builds our model directly on
the device in the target dtype, fills its weights, and gathers what the engine needs
around it (tokenizer, EOS ids, max length, fingerprint) into one frozen ``LoadedModel``.

Sources (``load_format``):

- ``auto``: a directory with ``config.json`` loads its ``*.safetensors`` (sharded ones via
  ``model.safetensors.index.json``); a ``.gguf`` file (or a directory holding exactly one)
  loads as GGUF; ``None`` loads the embedded default model (see ``default_model.py``).
- ``safetensors`` / ``gguf``: force that reader.
- ``dummy``: random weights (normal, std 0.02; norms 1.0) of the config's shapes, drawn on
  the device; only ``config.json`` (or a GGUF header) is read.

``quantization="fp8"`` builds the decoder's projections as ``Fp8Linear`` (see
``fp8_linear.py``): float checkpoints are quantized shard by shard as they are read, dummy
weights are drawn one projection at a time and quantized on the device (a 70B model never
exists in bf16), and a checkpoint stored in FP8 (``fp8_checkpoint.py``) is served in FP8
whatever was asked.

``dtype="auto"`` means float32 on the CPU and bfloat16 on CUDA, whatever the checkpoint
stores. The tokenizer is optional: a directory without tokenizer files yields ``None``
(token-id-only use).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from ragserve.devices import resolve_device, resolve_dtype
from ragserve.models import gguf_loader
from ragserve.models.default_model import DEFAULT_MODEL_NAME, default_model_path
from ragserve.models.fp8_checkpoint import resolve_quantization
from ragserve.models.fp8_linear import Fp8Linear
from ragserve.models.hf_config import read_hf_config
from ragserve.models.llama import QUANTIZATIONS, LlamaForCausalLM, ModelShape
from ragserve.models.registry import model_class_for
from ragserve.models.tokenizer import has_tokenizer_files, load_gguf_tokenizer, load_hf_tokenizer

if TYPE_CHECKING:
    from ragserve.config import EngineConfig

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
_DUMMY_STD = 0.02


@dataclass(frozen=True)
class LoadedModel:
    """A model with everything the engine needs to serve it.

    ``fingerprint`` is a hex digest of the architecture config, the weights' identity (file
    names, sizes and mtimes; a GGUF header digest; or the dummy seed), the dtype and the
    weight quantization: equal fingerprints mean equal KV for equal tokens, so it salts KV
    block hashes. ``quantization`` is the one served ("none" or "fp8").
    """

    model: LlamaForCausalLM
    hf_config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase | None
    eos_token_ids: list[int]
    max_model_len: int
    fingerprint: str
    name: str
    quantization: str = "none"

    @property
    def shape(self) -> ModelShape:
        return self.model.shape

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype


def load_model_from_config(config: EngineConfig) -> LoadedModel:
    """``load_model`` with the settings of an ``EngineConfig``."""
    return load_model(
        config.model,
        dtype=config.dtype,
        device=config.device,
        load_format=config.load_format,
        tokenizer=config.tokenizer,
        max_model_len=config.max_model_len,
        seed=config.seed,
        quantization=config.quantization,
    )


def load_model(
    model: str | Path | None,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    load_format: str = "auto",
    tokenizer: str | Path | None = None,
    max_model_len: int | None = None,
    seed: int = 0,
    quantization: str = "none",
) -> LoadedModel:
    """Load ``model`` (HF directory, ``.gguf`` file, or None for the default model).

    ``tokenizer`` overrides where the tokenizer comes from (an HF directory or hub id).
    ``max_model_len`` defaults to the config's ``max_position_embeddings`` and may not
    exceed it. ``seed`` only matters for ``load_format="dummy"``. ``quantization`` is
    "none" or "fp8" (the decoder's projections in e4m3).
    Raises ValueError for a missing path, an unsupported architecture, format or quantized
    layout, sliding window attention, or a checkpoint that does not match the config.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {list(LOAD_FORMATS)}, got {load_format!r}")
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    torch_device = resolve_device(device)
    options = _Options(
        device=torch_device,
        dtype=resolve_dtype(dtype, torch_device),
        dummy=load_format == "dummy",
        tokenizer=tokenizer,
        max_model_len=max_model_len,
        seed=seed,
        quantization=quantization,
    )
    path, kind = _locate(model, load_format)
    if kind == "gguf":
        return _load_gguf(path, options, is_default=model is None)
    return _load_hf_dir(path, options)


@dataclass(frozen=True)
class _Options:
    device: torch.device
    dtype: torch.dtype
    dummy: bool
    tokenizer: str | Path | None
    max_model_len: int | None
    seed: int
    quantization: str


def _locate(model: str | Path | None, load_format: str) -> tuple[Path, str]:
    """``(path, "gguf" | "hf")`` of the checkpoint to read."""
    if model is None:
        if load_format == "safetensors":
            raise ValueError("load_format='safetensors' needs a model directory, got no model")
        return default_model_path(), "gguf"
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model path {path} does not exist")
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ValueError(
                f"model directory {path} has no config.json and {len(ggufs)} .gguf files (need exactly one)"
            )
        path = ggufs[0]
    kind = "gguf" if path.is_file() else "hf"
    if kind == "gguf" and path.suffix != ".gguf" and load_format != "gguf":
        raise ValueError(
            f"model file {path} is not a .gguf file; pass an HF directory or a GGUF file"
        )
    if (kind, load_format) in (("gguf", "safetensors"), ("hf", "gguf")):
        raise ValueError(f"load_format={load_format!r} does not fit {path}")
    return path, kind


def _max_len(config: PretrainedConfig, requested: int | None) -> int:
    limit = int(config.max_position_embeddings)
    if requested is None:
        return limit
    if not 0 < requested <= limit:
        raise ValueError(f"max_model_len must be in [1, {limit}] for this model, got {requested}")
    return requested


def _build(config: PretrainedConfig, options: _Options) -> tuple[LlamaForCausalLM, int]:
    max_len = _max_len(config, options.max_model_len)
    cls = model_class_for(config)
    model = cls(
        config,
        device=options.device,
        dtype=options.dtype,
        max_model_len=max_len,
        quantization=resolve_quantization(options.quantization, config),
    )
    return model, max_len


def _load_hf_dir(directory: Path, options: _Options) -> LoadedModel:
    config = read_hf_config(directory)
    model, max_len = _build(config, options)
    if options.dummy:
        init_dummy_weights(model, options.seed)
        identity: Any = {"dummy_seed": options.seed}
    else:
        files = safetensors_files(directory)
        model.load_weights(iter_safetensors(files))
        identity = [_file_identity(f) for f in files]
    if options.tokenizer is not None:
        tokenizer: PreTrainedTokenizerBase | None = load_hf_tokenizer(options.tokenizer)
    elif has_tokenizer_files(directory):
        tokenizer = load_hf_tokenizer(directory)
    else:
        tokenizer = None
    generation_eos = _generation_config_eos(directory / "generation_config.json")
    return LoadedModel(
        model=model,
        hf_config=config,
        tokenizer=tokenizer,
        eos_token_ids=_eos_token_ids(generation_eos, config, tokenizer),
        max_model_len=max_len,
        fingerprint=compute_fingerprint(config, identity, options.dtype, model.quantization),
        name=directory.resolve().name,
        quantization=model.quantization,
    )


def _load_gguf(path: Path, options: _Options, *, is_default: bool) -> LoadedModel:
    checkpoint = gguf_loader.open_gguf(path)
    config = checkpoint.config
    model, max_len = _build(config, options)
    identity: dict[str, Any] = {"gguf_header": checkpoint.header_digest}
    if options.dummy:
        init_dummy_weights(model, options.seed)
        identity["dummy_seed"] = options.seed
    else:
        model.load_weights(gguf_loader.iter_gguf_weights(checkpoint))
        factors = gguf_loader.rope_frequency_factors(checkpoint)
        if factors is not None:
            model.set_rope_frequency_factors(factors)
    if options.tokenizer is not None:
        tokenizer: PreTrainedTokenizerBase | None = load_hf_tokenizer(options.tokenizer)
    elif checkpoint.has_tokenizer:
        tokenizer = load_gguf_tokenizer(path, checkpoint.header_digest)
    else:
        tokenizer = None
    return LoadedModel(
        model=model,
        hf_config=config,
        tokenizer=tokenizer,
        eos_token_ids=_eos_token_ids(None, config, tokenizer),
        max_model_len=max_len,
        fingerprint=compute_fingerprint(config, identity, options.dtype, model.quantization),
        name=DEFAULT_MODEL_NAME if is_default else path.stem,
        quantization=model.quantization,
    )


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of ``directory``: those of the shard index, else every ``*.safetensors``."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise ValueError(f"malformed shard index {index}: {exc}") from exc
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index} names shards that do not exist: {missing}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"no *.safetensors weights in {directory} (only safetensors checkpoints are supported)"
        )
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor in ``files``, read on the host one at a time."""
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    yield name, handle.get_tensor(name)
        except (OSError, SafetensorError) as exc:
            raise ValueError(f"cannot read weights from {file}: {exc}") from exc


def init_dummy_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights drawn on the model's device: norms 1.0, everything else N(0, 0.02).

    An FP8 projection's weight is drawn in the model dtype and quantized by ``Fp8Linear.load``
    (its scales with it), one projection at a time: at most one float projection exists.
    """
    generator = torch.Generator(device=model.device)
    generator.manual_seed(seed)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, param in model.named_parameters():
            module_name, _, kind = name.rpartition(".")
            module = modules[module_name]
            if isinstance(module, Fp8Linear) and kind in ("weight", "weight_scale"):
                if kind == "weight":
                    drawn = torch.empty(param.shape, device=param.device, dtype=model.dtype)
                    drawn.normal_(0.0, _DUMMY_STD, generator=generator)
                    module.load("weight", drawn, 0, param.shape[0])
                    del drawn
            elif name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, _DUMMY_STD, generator=generator)
    model.pack_cpu_weights()  # the weights changed: refresh any prepacked CPU copies


def compute_fingerprint(
    config: PretrainedConfig,
    weights_identity: Any,
    dtype: torch.dtype,
    quantization: str = "none",
) -> str:
    """sha256 over the config (minus bookkeeping keys), the weights' identity, the dtype and
    the weight quantization (FP8 weights compute other KV than the same weights in bf16)."""
    config_dict = {
        key: value
        for key, value in config.to_dict().items()
        if not key.startswith("_") and key != "transformers_version"
    }
    payload: dict[str, Any] = {
        "config": config_dict,
        "weights": weights_identity,
        "dtype": str(dtype),
    }
    # NOTE: added only when quantized, so unquantized fingerprints (and the KV records
    # on disk and in remote stores keyed by them) stay what they were.
    if quantization != "none":
        payload["quantization"] = quantization
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def _file_identity(path: Path) -> list[Any]:
    stat = path.stat()
    return [path.name, stat.st_size, stat.st_mtime_ns]


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _generation_config_eos(path: Path) -> list[int] | None:
    if not path.is_file():
        return None
    try:
        return _as_id_list(json.loads(path.read_text()).get("eos_token_id"))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"malformed {path}: {exc}") from exc


def _eos_token_ids(
    generation_eos: list[int] | None,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase | None,
) -> list[int]:
    """generation_config.json's EOS ids (else the config's), plus the tokenizer's, deduplicated."""
    ids = (
        generation_eos
        if generation_eos is not None
        else _as_id_list(getattr(config, "eos_token_id", None))
    )
    if tokenizer is not None:
        ids = ids + _as_id_list(tokenizer.eos_token_id)
    return list(dict.fromkeys(ids))
