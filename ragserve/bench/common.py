"""Shared pieces of the benchmarks: workloads, the transformers baseline, tables, JSON."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def random_prompts(count: int, length: int | Sequence[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of random content (throughput does not depend on the text)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [length] * count if isinstance(length, int) else list(length)
    # Stay clear of the low ids, where special tokens usually live.
    return [torch.randint(100, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def load_transformers_model(model_path: str | None, load_format: str, dtype: torch.dtype, device: torch.device) -> Any:
    """The same model through transformers, as the baseline."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ragserve.models.default_model import default_model_path

    path = Path(model_path) if model_path else default_model_path()
    if load_format == "dummy":
        config = AutoConfig.from_pretrained(path)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    elif path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


@torch.inference_mode()
def transformers_generate(
    model: Any, prompts: list[list[int]], max_new_tokens: int, batch_size: int, pad_token_id: int
) -> tuple[float, int]:
    """Greedy padded-batch ``generate`` with EOS ignored. Returns (seconds, output tokens)."""
    device = next(model.parameters()).device
    started = time.perf_counter()
    produced = 0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, prompt in enumerate(chunk):  # left padding, as generation needs
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_token_id,
        )
        produced += (out.shape[1] - width) * len(chunk)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started, produced


def machine_description() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[str(c) for c in header]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print(f"\n{title}")
    for index, row in enumerate(cells):
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
        if index == 0:
            print("  ".join("-" * width for width in widths))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine_description(), "torch": torch.__version__, **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nwrote {path}")
    return path


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
