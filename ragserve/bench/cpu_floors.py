"""This CPU's ceilings, measured, and the floors they put under the ``bench cpu`` figures.

A prefill needs its FLOPs at the matmul rate of the dtype; a decode step needs the larger of
its FLOPs at that rate and its bytes (every weight once, plus the KV it attends over) at the
memory read bandwidth. Everything else an engine does only adds to these.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ragserve.bench.cpu_workload import Workload
from ragserve.bench.shapes import non_embedding_params, prefill_flops
from ragserve.engine.engine_info import ModelShape

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # the first call sets up (oneDNN primitives, page faults)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def measure_ceilings(repeats: int = 5, size: int = 2048) -> dict[str, float]:
    """Matmul GFLOP/s per dtype with all of torch's threads, and read GB/s; best of repeats.

    The matmul is ``F.linear``, the op of the models' linear layers: in bf16 it is oneDNN's
    inner product, where ``torch.mm`` may take a path a hundred times slower (no AVX-512 BF16).
    In float32 ``F.linear`` is MKL's, and oneDNN's product over a prepacked weight is timed
    too, the faster counting: on a 2-core AMD EPYC (AVX-512) oneDNN ran 221-227 GFLOP/s where
    MKL ran 186-205, and an engine on oneDNN took less than a floor at MKL's rate.
    """
    ceilings: dict[str, float] = {}
    for name, dtype in DTYPES.items():
        x = torch.randn(size, size).to(dtype)
        weight = torch.randn(size, size).to(dtype)
        seconds = _best_seconds(functools.partial(F.linear, x, weight), repeats)
        if dtype == torch.float32 and torch.backends.mkldnn.is_available():
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, size)
                onednn = functools.partial(
                    torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], ""
                )
                seconds = min(seconds, _best_seconds(onednn, repeats))
            except RuntimeError:  # NOTE: a build whose oneDNN takes no float32 product
                pass
        ceilings[f"matmul_gflops_{name}"] = 2 * size**3 / seconds / 1e9
    data = torch.ones(2**28 // 4)  # 256 MiB: far beyond any cache
    seconds = _best_seconds(data.sum, repeats)
    ceilings["read_gbps"] = data.nbytes / seconds / 1e9
    return ceilings


def best_ceilings(*measured: dict[str, float]) -> dict[str, float]:
    """Each ceiling's highest value over several measurements (on a shared host, the
    quietest minute's)."""
    return {key: max(m[key] for m in measured) for key in measured[0]}


def cpu_features() -> dict[str, Any]:
    """What decides the bf16 figures: the vector ISA torch uses and oneDNN's native bf16."""
    return {
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_bf16": bool(
            torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        ),
        "threads": torch.get_num_threads(),
    }


def _decode_step_s(
    shape: ModelShape, contexts: list[int], dtype: torch.dtype, gflops: float, gbps: float
) -> float:
    """One decode step of len(contexts) sequences, each attending over its context."""
    params = non_embedding_params(shape) + shape.vocab_size * shape.hidden_size  # + LM head
    keys = sum(contexts)
    flops = (
        2.0 * params * len(contexts)
        + 4.0 * keys * shape.num_heads * shape.head_dim * shape.num_layers
    )
    nbytes = params * dtype.itemsize + keys * shape.kv_bytes_per_token(dtype)
    return max(flops / (gflops * 1e9), nbytes / (gbps * 1e9))


def floors(
    shape: ModelShape, workload: Workload, dtype: str, ceilings: dict[str, float]
) -> dict[str, Any]:
    """The least time each timed figure could take here; throughput also as tok/s.

    bf16 work counts at the faster of the bf16 and float32 matmul rates: bf16 values
    multiply exactly in float32, and where the CPU has no AMX float32 is the faster rate
    (ragserve's long bf16 products run there, ``kernels/cpu_linear.py``)."""
    gflops = max(ceilings[f"matmul_gflops_{dtype}"], ceilings["matmul_gflops_float32"])
    gbps = ceilings["read_gbps"]
    torch_dtype = DTYPES[dtype]
    w = workload

    def prefill_s(tokens: int, context: int = 0) -> float:
        return prefill_flops(shape, tokens, context) / (gflops * 1e9)

    def decode_s(context: int, steps: int, batch: int) -> float:
        # step s (1-based) of each sequence attends over context + s keys
        return sum(
            _decode_step_s(shape, [context + s] * batch, torch_dtype, gflops, gbps)
            for s in range(1, steps)
        )

    throughput_s = w.num_prompts * prefill_s(w.input_len) + decode_s(
        w.input_len, w.output_len, w.num_prompts
    )
    prompt = w.doc_tokens + w.question_tokens
    answer_s = decode_s(prompt, w.answer_tokens, 1)
    cold_s = prefill_s(prompt) + answer_s
    cached_s = prefill_s(w.question_tokens, context=w.doc_tokens) + answer_s
    return {
        "throughput_s": throughput_s,
        "throughput_tok_s": w.output_tokens / throughput_s,
        "ttft_s": {str(n): prefill_s(n) for n in w.ttft_lengths},
        "question_cold_s": cold_s,
        "question_cached_s": cached_s,
        "questions_total_s": cold_s + (w.num_questions - 1) * cached_s,
    }
