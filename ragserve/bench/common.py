"""Shared pieces of the benchmarks: workloads, the transformers baseline, JSON."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ragserve.config import EngineConfig
from ragserve.devices import resolve_device


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``low`` (a clear usage error otherwise)."""

    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = "int"  # NOTE: argparse names the type in "invalid int value: 'x'"
    return parse


def for_its_device(config: EngineConfig) -> EngineConfig:
    """``config`` with its device's defaults filled in (see ``EngineConfig.for_device``), for a
    benchmark that reads them before (or besides) the engine it builds."""
    return config.for_device(resolve_device(config.device).type)


def random_prompts(
    count: int, length: int | Sequence[int], vocab_size: int, seed: int = 0
) -> list[list[int]]:
    """Token-id prompts of random content (throughput does not depend on the text)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [length] * count if isinstance(length, int) else list(length)
    # Stay clear of the low ids, where special tokens usually live.
    return [torch.randint(100, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def load_transformers_model(
    model_path: str | None, load_format: str, dtype: torch.dtype, device: torch.device
) -> Any:
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


def succeeded(outputs: list[Any]) -> list[Any]:
    """``outputs`` of ``LLM.generate``; RuntimeError naming the first failed request (a
    figure over failed requests would mislead)."""
    for output in outputs:
        if output.error:
            raise RuntimeError(f"request {output.request_id} failed: {output.error}")
    return outputs


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


def transformers_generate_batch(
    model: Any, prompts: list[list[int]], max_new_tokens: int
) -> tuple[float, int]:
    """transformers' own continuous batching (``generate_batch``), greedy, EOS never ends a
    request. Returns (seconds, output tokens)."""
    from transformers import GenerationConfig

    # NOTE: without an EOS id continuous batching runs every request to max_new_tokens.
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
    device = next(model.parameters()).device
    started = time.perf_counter()
    outputs = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    failed = [out.error for out in outputs.values() if getattr(out, "error", None)]
    produced = sum(len(out.generated_tokens) for out in outputs.values())
    if len(outputs) != len(prompts) or failed or produced != len(prompts) * max_new_tokens:
        raise RuntimeError(
            f"generate_batch finished {len(outputs)} of {len(prompts)} requests with {produced} "
            f"tokens, not {len(prompts) * max_new_tokens}: {failed[:1]}"
        )
    return seconds, produced


@dataclass
class RequestTiming:
    """Wall-clock times of one request run alone through the engine's step loop."""

    ttft_s: float
    token_times_s: list[float] = field(default_factory=list)  # since submission, one per token
    num_cached_tokens: int = 0
    num_blended_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # the answer

    @property
    def decode_ms_per_token(self) -> float | None:
        """Mean time between tokens after the first; None with fewer than two tokens."""
        times = self.token_times_s
        if len(times) < 2:
            return None
        return (times[-1] - times[0]) / (len(times) - 1) * 1e3


def time_request(
    engine: Any,
    prompt: list[int],
    max_tokens: int,
    *,
    request_id: str,
    persist: bool = False,
    on_first_token: Callable[[], None] | None = None,
    **request_options: Any,
) -> RequestTiming:
    """Submit one greedy request (EOS ignored) and step the engine until it finishes.

    Each engine step ends with the sampled tokens on the host (one sync), so the clock
    read after a step that produced a token is when that token exists.
    ``on_first_token`` runs right after the first token (e.g. to read peak device memory
    before decoding starts). ``request_options`` go to ``add_request`` (e.g. ``documents``).
    """
    from ragserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    engine.add_request(request_id, prompt, params, persist=persist, **request_options)
    timing = RequestTiming(ttft_s=0.0)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id != request_id:
                continue
            if output.error:
                raise RuntimeError(f"request {request_id} failed: {output.error}")
            now = time.perf_counter() - started
            produced = len(output.outputs[0].token_ids)
            if produced and not timing.token_times_s:
                timing.ttft_s = now
                timing.num_cached_tokens = output.num_cached_tokens
                timing.num_blended_tokens = output.num_blended_tokens
                if on_first_token is not None:
                    on_first_token()
            timing.token_times_s.extend([now] * (produced - len(timing.token_times_s)))
            timing.token_ids = list(output.outputs[0].token_ids)
    return timing


def release_device_memory() -> None:
    """Return freed blocks to the device after an engine or model is dropped."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# One NVIDIA H200: bf16 dense matmul ceiling and device copy bandwidth.
H200_PEAK_TFLOPS = 791.0
H200_PEAK_TBPS = 4.25
# Its FP8 (e4m3) matmul ceiling: ``torch._scaled_mm`` with row-wise scales, 8192^3, measured
# on an NVIDIA H200 (1,347 TFLOP/s; bf16 769 in the same run).
H200_PEAK_FP8_TFLOPS = 1347.0


def add_peak_arguments(parser: Any) -> None:
    """The hardware peaks the floors use; see ``resolve_peaks`` for the defaults."""
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help=f"matmul ceiling, TFLOP/s (on CUDA default {H200_PEAK_TFLOPS:g}, one H200)",
    )
    parser.add_argument(
        "--peak-fp8-tflops",
        type=float,
        default=None,
        help="FP8 matmul ceiling for --quantization fp8 runs' projections, TFLOP/s "
        f"(on CUDA default {H200_PEAK_FP8_TFLOPS:g}, one H200)",
    )
    parser.add_argument(
        "--peak-tbps",
        type=float,
        default=None,
        help=f"memory bandwidth, TB/s (on CUDA default {H200_PEAK_TBPS:g}, one H200)",
    )


def resolve_peaks(args: Any, device: torch.device) -> bool:
    """Fill in the H200's peaks on CUDA where none were given; True when floors apply.

    Elsewhere there is no floor unless both peaks are given (a GPU's peaks say nothing
    about a CPU); then both are cleared, so every floor of a run is there or none is.
    """
    if device.type == "cuda":
        args.peak_tflops = args.peak_tflops or H200_PEAK_TFLOPS
        args.peak_tbps = args.peak_tbps or H200_PEAK_TBPS
        args.peak_fp8_tflops = getattr(args, "peak_fp8_tflops", None) or H200_PEAK_FP8_TFLOPS
    if args.peak_tflops is None or args.peak_tbps is None:
        args.peak_tflops = args.peak_tbps = args.peak_fp8_tflops = None
        return False
    return True


def machine_description() -> str:
    """The host's CPU, and its GPU where one is present (a run may use either)."""
    cpu = f"{platform.processor() or platform.machine()} CPU, {os.cpu_count()} cores"
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} GPU; {cpu}"
    return cpu


def write_json(path: str | Path, payload: dict[str, Any], quiet: bool = False) -> Path:
    """Write the results (called after each phase too, so a later failure keeps them)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": machine_description(), "torch": torch.__version__, **payload}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    tmp.replace(path)
    if not quiet:
        print(f"\nwrote {path}", flush=True)
    return path


def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
