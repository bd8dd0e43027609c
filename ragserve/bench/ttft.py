"""``ragserve bench ttft``: cold time to first token of long prompts, against transformers and
the FLOP floor; decode after the longest prefill, and peak device memory during it."""

from __future__ import annotations

import argparse
import inspect
import traceback
from typing import Any

import torch

from ragserve.bench.common import (
    RequestTiming,
    add_peak_arguments,
    for_its_device,
    load_transformers_model,
    random_prompts,
    release_device_memory,
    resolve_peaks,
    time_request,
    write_json,
)
from ragserve.bench.shapes import (
    compute_floor_s,
    decode_floor_s,
    decode_weight_bytes,
    linear_flops,
    non_embedding_params,
    prefill_flops,
)
from ragserve.config import EngineConfig
from ragserve.engine.engine_info import EngineInfo, ModelShape
from ragserve.table import print_table

GIB = 2**30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lengths", default="8192,32768,131072", help="prompt lengths, comma-separated"
    )
    parser.add_argument(
        "--decode-tokens", type=int, default=32, help="decoded after the longest prompt"
    )
    parser.add_argument("--skip-transformers", action="store_true")
    add_peak_arguments(parser)
    parser.add_argument("--out", default="bench-results/ttft.json")


def _lengths(args: argparse.Namespace) -> list[int]:
    try:
        lengths = sorted({int(x) for x in args.lengths.split(",") if x.strip()})
    except ValueError:
        raise ValueError(
            f"--lengths must be comma-separated integers, got {args.lengths!r}"
        ) from None
    if not lengths or lengths[0] < 1:
        raise ValueError(f"--lengths needs positive lengths, got {args.lengths!r}")
    if args.decode_tokens < 0:
        raise ValueError(f"--decode-tokens must be >= 0, got {args.decode_tokens}")
    return lengths


def required_model_len(args: argparse.Namespace) -> int:
    """The longest prompt, its first token and the decode tokens after it."""
    return max(_lengths(args)) + args.decode_tokens + 1


def _prompt(length: int, vocab: int, seed: int = 1000) -> list[int]:
    return random_prompts(1, length, vocab, seed=seed + length)[0]


def _max_allocated() -> int | None:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def _run_ragserve(
    config: EngineConfig,
    lengths: list[int],
    args: argparse.Namespace,
    results: dict[str, Any],
    state: dict[str, ModelShape],
) -> None:
    """Every length through the engine (chunked by max_num_batched_tokens); fills ``results``
    and ``state["shape"]`` (set first, so a later failure still leaves the floors computable)."""
    from ragserve import LLM

    llm = LLM.from_config(config)
    try:
        engine, info = llm.engine, llm.info
        shape = info.model_shape
        state["shape"] = shape
        vocab = shape.vocab_size
        weights = info.weight_bytes
        results["memory"] = {"weights_bytes": weights, "kv_cache_bytes": info.kv_cache_bytes}
        if resolve_peaks(args, info.device):
            results["workload"] |= {"peak_tflops": args.peak_tflops, "peak_tbps": args.peak_tbps}
        results["workload"] |= {
            "dtype": str(info.dtype),
            "device": str(info.device),
            "non_embedding_params": non_embedding_params(shape),
            "weight_bytes": weights,
        }
        # Warm-up: whole chunks, a chunk after cached context and decodes, so Triton
        # compiles before anything is timed.
        chunk = config.step_tokens
        warm_up = min(lengths[-1], 2 * chunk + chunk // 2)
        time_request(engine, random_prompts(1, warm_up, vocab, seed=7)[0], 3, request_id="warm-up")
        llm.reset_prefix_cache()

        longest = lengths[-1]
        for length in lengths:
            tokens = 1 + (args.decode_tokens if length == longest else 0)
            # NOTE: each length twice, with other tokens so the KV is as cold: the first run
            # pays first-use costs (cuDNN builds an execution plan per new attention shape,
            # 45-600 ms measured), the second is the figure; both are reported.
            first = time_request(
                engine, _prompt(length, vocab), tokens, request_id=f"first-{length}"
            )
            llm.reset_prefix_cache()
            peak: dict[str, int | None] = {}
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()

            def read_peak(peak: dict[str, int | None] = peak) -> None:
                peak["prefill"] = _max_allocated()

            warm = time_request(
                engine,
                _prompt(length, vocab, seed=2000),
                tokens,
                request_id=f"ttft-{length}",
                on_first_token=read_peak,
            )
            llm.reset_prefix_cache()
            row = results["rows"].setdefault(str(length), {"length": length})
            row["ragserve_chunks"] = -(-length // chunk)
            row["ragserve_s"] = warm.ttft_s
            row["ragserve_first_s"] = first.ttft_s
            row["ragserve_cached_tokens"] = warm.num_cached_tokens
            print(
                f"ragserve  {length:>7} tokens: TTFT {warm.ttft_s:.3f} s, first run "
                f"{first.ttft_s:.3f} s ({-(-length // chunk)} chunks of <= {chunk})",
                flush=True,
            )
            if length == longest:
                _record_decode(results, warm, first, info, length, peak.get("prefill"), args)
    finally:
        llm.close()
        del llm
        release_device_memory()


def _record_decode(
    results: dict[str, Any],
    timing: RequestTiming,
    first: RequestTiming,
    info: EngineInfo,
    length: int,
    peak_prefill: int | None,
    args: argparse.Namespace,
) -> None:
    memory = results["memory"]
    memory["peak_allocated_prefill_bytes"] = peak_prefill
    if peak_prefill is not None:
        memory["peak_over_weights_and_kv_bytes"] = (
            peak_prefill - memory["weights_bytes"] - memory["kv_cache_bytes"]
        )
    kv_bytes = (length + args.decode_tokens) * info.kv_bytes_per_token
    read_bytes = decode_weight_bytes(info.model_shape, info.dtype.itemsize, info.quantization)
    results["decode"] = {
        "context": length,
        "tokens": args.decode_tokens,
        "ragserve_ms_per_token": timing.decode_ms_per_token,
        "ragserve_first_ms_per_token": first.decode_ms_per_token,
        "weight_bytes_read_per_step": read_bytes,
    }
    if args.peak_tbps is not None:
        results["decode"]["floor_ms_per_token"] = (
            decode_floor_s(read_bytes, kv_bytes, args.peak_tbps) * 1e3
        )
    print(
        f"ragserve  decode after {length} tokens: {timing.decode_ms_per_token or 0:.2f} ms/token "
        f"over {args.decode_tokens} tokens, first run {first.decode_ms_per_token or 0:.2f}",
        flush=True,
    )


def _hf_fits(hf: Any, shape: ModelShape, length: int) -> str | None:
    """Why a one-pass transformers prefill of ``length`` tokens would not fit, or None."""
    if not torch.cuda.is_available():
        return None
    free = (
        torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    )
    itemsize = next(hf.parameters()).element_size()
    kv = length * shape.kv_bytes_per_token(next(hf.parameters()).dtype)
    # NOTE: live activations of one layer: the MLP's gate/up/act and a few hidden-size tensors.
    activations = length * (3 * shape.intermediate_size + 8 * shape.hidden_size) * itemsize
    needed = kv + activations
    if needed > free:
        return f"would not fit: needs ~{needed / GIB:.1f} GiB, {free / GIB:.1f} GiB free"
    return None


@torch.inference_mode()
def _hf_prefill_and_decode(
    hf: Any, prompt: list[int], decode_tokens: int
) -> tuple[float, float | None]:
    """One-pass prefill to the first token, then ``decode_tokens`` greedy steps on its cache."""
    import time

    device = next(hf.parameters()).device
    ids = torch.tensor([prompt], device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    out = hf(input_ids=ids, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    token.item()  # the first token on the host, as a server would need it
    ttft = time.perf_counter() - started
    if decode_tokens <= 0:
        return ttft, None
    # NOTE: newer transformers name it ``cache`` (and warn on ``past_key_values``)
    cache_name = (
        "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    )
    cache = getattr(out, cache_name)
    del out
    first = time.perf_counter()
    for _ in range(decode_tokens):
        out = hf(input_ids=token, use_cache=True, logits_to_keep=1, **{cache_name: cache})
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        token.item()
    return ttft, (time.perf_counter() - first) / decode_tokens * 1e3


def _run_transformers(
    config: EngineConfig,
    shape: ModelShape,
    lengths: list[int],
    args: argparse.Namespace,
    results: dict[str, Any],
) -> None:
    dtype = getattr(torch, results["workload"]["dtype"].removeprefix("torch."))
    device = torch.device(results["workload"]["device"])
    hf = load_transformers_model(config.model, config.load_format, dtype, device)
    try:
        for length in lengths:
            row = results["rows"][str(length)]
            reason = _hf_fits(hf, shape, length)
            decode = args.decode_tokens if length == lengths[-1] else 0
            if reason is None:
                try:
                    # NOTE: as for ragserve: a first run at this length, then the timed one.
                    runs = [
                        _hf_prefill_and_decode(hf, _prompt(length, shape.vocab_size, seed), decode)
                        for seed in (1000, 2000)
                    ]
                    (
                        (row["transformers_first_s"], first_decode),
                        (row["transformers_s"], hf_decode),
                    ) = runs
                    if decode:
                        results.setdefault("decode", {}).update(
                            transformers_ms_per_token=hf_decode,
                            transformers_first_ms_per_token=first_decode,
                        )
                except torch.OutOfMemoryError as exc:
                    reason = f"out of memory: {str(exc).splitlines()[0]}"
                release_device_memory()
            if reason is not None:
                row["transformers_skipped"] = reason
                print(f"transformers {length:>7} tokens: skipped ({reason})", flush=True)
            else:
                print(
                    f"transformers {length:>7} tokens: TTFT {row['transformers_s']:.3f} s, "
                    f"first run {row['transformers_first_s']:.3f} s",
                    flush=True,
                )
            write_json(args.out, results, quiet=True)
    finally:
        del hf
        release_device_memory()


def _print_tables(results: dict[str, Any], args: argparse.Namespace) -> None:
    rows = []
    for row in results["rows"].values():
        floor = row.get("floor_s")
        ours, theirs = row.get("ragserve_s"), row.get("transformers_s")
        rows.append(
            [
                row["length"],
                ours,
                theirs if theirs is not None else row.get("transformers_skipped", "-"),
                floor,
                ours / floor if ours and floor else None,
                theirs / floor if theirs and floor else None,
                theirs / ours if ours and theirs else None,
                row.get("ragserve_first_s"),
                row.get("transformers_first_s"),
            ]
        )
    no_floor = "no floor (give --peak-tflops and --peak-tbps)"
    print_table(
        f"cold-cache TTFT, one request, chunks of {results['workload']['max_num_batched_tokens']} "
        "tokens, each engine's second run at the length (first runs on the right); "
        + (
            f"floor = prefill FLOPs / {args.peak_tflops:g} TFLOP/s"
            + (
                f" (projections / {args.peak_fp8_tflops:g} FP8)"
                if results["workload"].get("quantization") == "fp8"
                else ""
            )
            if args.peak_tflops
            else no_floor
        ),
        [
            "tokens",
            "ragserve s",
            "transformers s",
            "floor s",
            "ragserve/floor",
            "transformers/floor",
            "speed-up",
            "ragserve first s",
            "transformers first s",
        ],
        rows,
    )
    decode = results.get("decode")
    if decode:
        ours, floor = decode.get("ragserve_ms_per_token"), decode.get("floor_ms_per_token")
        print_table(
            f"batch-1 decode after a {decode['context']}-token prefill, {decode['tokens']} tokens; "
            + (
                f"floor = (weights a step reads + KV) / {args.peak_tbps:g} TB/s"
                if floor
                else no_floor
            ),
            [
                "context",
                "ragserve ms/token",
                "transformers ms/token",
                "floor ms/token",
                "ragserve/floor",
                "ragserve first",
                "transformers first",
            ],
            [
                [
                    decode["context"],
                    ours,
                    decode.get("transformers_ms_per_token"),
                    floor,
                    ours / floor if ours and floor else None,
                    decode.get("ragserve_first_ms_per_token"),
                    decode.get("transformers_first_ms_per_token"),
                ]
            ],
        )
    memory = results.get("memory", {})
    if memory.get("peak_allocated_prefill_bytes") is not None:
        print(
            f"\npeak device memory allocated during the {decode['context'] if decode else ''}-token "
            f"prefill: {memory['peak_allocated_prefill_bytes'] / GIB:.2f} GiB = weights "
            f"{memory['weights_bytes'] / GIB:.2f} + KV cache {memory['kv_cache_bytes'] / GIB:.2f} "
            f"+ {memory['peak_over_weights_and_kv_bytes'] / GIB:.2f} GiB activations/other",
            flush=True,
        )


def _record_failure(results: dict[str, Any], phase: str, exc: Exception) -> None:
    traceback.print_exc()
    results["errors"].append(f"{phase}: {type(exc).__name__}: {exc}")
    release_device_memory()


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    config = for_its_device(config)
    lengths = _lengths(args)
    results: dict[str, Any] = {
        "workload": {
            "lengths": lengths,
            "decode_tokens": args.decode_tokens,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "model": config.model or "default",
            "load_format": config.load_format,
            "quantization": config.quantization,
        },
        "rows": {},
        "errors": [],
    }
    state: dict[str, ModelShape] = {}
    try:
        _run_ragserve(config, lengths, args, results, state)
    except Exception as exc:  # NOTE: keep what was measured; the JSON says what failed.
        _record_failure(results, "ragserve", exc)
    release_device_memory()  # NOTE: now that the engine is unreferenced
    shape = state.get("shape")
    if shape is not None:
        for length in lengths:
            flops = prefill_flops(shape, length)
            results["rows"].setdefault(str(length), {"length": length})
            results["rows"][str(length)]["flops"] = flops
            if args.peak_tflops is not None:
                fp8 = linear_flops(shape, length) if config.quantization == "fp8" else 0.0
                results["rows"][str(length)]["floor_s"] = compute_floor_s(
                    flops, fp8, args.peak_tflops, args.peak_fp8_tflops
                )
        write_json(args.out, results, quiet=True)
        if not args.skip_transformers:
            try:
                _run_transformers(config, shape, lengths, args, results)
            except Exception as exc:
                _record_failure(results, "transformers", exc)
    _print_tables(results, args)
    write_json(args.out, results)
    return 1 if results["errors"] else 0
