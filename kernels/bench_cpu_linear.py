"""bf16 products on the CPU, paired against the path without pairs: ``python -m kernels.bench_cpu_linear``.

One repeat runs SmolLM2-shaped attention and MLP projections for every layer of
``--layers`` (random weights, so that they come from memory as in a model step) at each
row count: ``paired`` multiplies over the weights laid out in pairs, SiLU fused into the
gate/up product past two rows (``kernels/cpu_linear.py``); ``unpaired`` runs what the
weights take without a paired copy, one or two rows streaming the plain weight
(``csrc/cpu_small_linear.c``), more over oneDNN's packed weight, each with a separate SiLU
pass. The two alternate repeat by repeat; the table gives each one's median and best wall
time, its GFLOP/s at the best, and the ratio of the medians. Needs a CPU whose bf16
products run paired (AVX-512 BF16 without AMX).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from kernels import cpu_layer_ops, cpu_linear
from ragserve.engine.cpu_malloc import keep_freed_memory
from ragserve.table import print_table

# SmolLM2-135M: hidden 576, 9 query and 3 kv heads of 64, intermediate 1536
HIDDEN, INTERMEDIATE, QKV = 576, 1536, 960


def layer_weights(generator: torch.Generator) -> dict[str, torch.Tensor]:
    shapes = {
        "qkv": (QKV, HIDDEN),
        "o": (HIDDEN, HIDDEN),
        "gate_up": (2 * INTERMEDIATE, HIDDEN),
        "down": (HIDDEN, INTERMEDIATE),
    }
    return {
        name: (torch.randn(*shape, generator=generator) * 0.05).bfloat16()
        for name, shape in shapes.items()
    }


def paired_step(layers: list[dict[str, torch.Tensor]], rows: int) -> Callable[[], None]:
    pairs = [{name: cpu_linear.pair_weight(w) for name, w in layer.items()} for layer in layers]
    hidden = torch.randn(rows, HIDDEN).bfloat16()
    fused = rows > cpu_linear.BF16_SMALL_LINEAR_MAX_ROWS

    def run() -> None:
        for layer in pairs:
            cpu_linear.pairs_linear(hidden, layer["qkv"], None, QKV)
            cpu_linear.pairs_linear(hidden, layer["o"], None, HIDDEN)
            if fused:
                act = cpu_linear.pairs_silu_mul(hidden, layer["gate_up"], None, INTERMEDIATE)
            else:
                gate_up = cpu_linear.pairs_linear(hidden, layer["gate_up"], None, 2 * INTERMEDIATE)
                act = cpu_layer_ops.silu_and_mul(gate_up)
            cpu_linear.pairs_linear(act, layer["down"], None, HIDDEN)

    return run


def unpaired_step(layers: list[dict[str, torch.Tensor]], rows: int) -> Callable[[], None]:
    streamed = rows <= cpu_linear.BF16_SMALL_LINEAR_MAX_ROWS
    weights = layers if streamed else [
        {name: cpu_linear.pack_weight(w) for name, w in layer.items()} for layer in layers
    ]  # fmt: skip
    hidden = torch.randn(rows, HIDDEN).bfloat16()

    def product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if streamed:
            return cpu_linear.small_linear(x, weight, None)
        return cpu_linear.packed_linear(x, weight, None)

    def run() -> None:
        for layer in weights:
            product(hidden, layer["qkv"])
            product(hidden, layer["o"])
            act = cpu_layer_ops.silu_and_mul(product(hidden, layer["gate_up"]))
            product(act, layer["down"])

    return run


def step_flops(rows: int, layers: int) -> float:
    per_row = QKV * HIDDEN + HIDDEN * HIDDEN + 2 * INTERMEDIATE * HIDDEN + HIDDEN * INTERMEDIATE
    return 2.0 * rows * per_row * layers


def measure(rows: int, layers: list[dict[str, torch.Tensor]], repeats: int) -> dict[str, Any]:
    steps = {"paired": paired_step(layers, rows), "unpaired": unpaired_step(layers, rows)}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():
        step()  # warm at this shape
    for repeat in range(repeats):
        order = list(steps) if repeat % 2 == 0 else list(reversed(steps))
        for name in order:
            started = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - started)
    work = step_flops(rows, len(layers))
    result: dict[str, Any] = {"rows": rows}
    for name, samples in times.items():
        result[f"{name}_median_ms"] = statistics.median(samples) * 1e3
        result[f"{name}_best_ms"] = min(samples) * 1e3
        result[f"{name}_gflops"] = work / min(samples) / 1e9
    result["unpaired_path"] = (
        "streamed" if rows <= cpu_linear.BF16_SMALL_LINEAR_MAX_ROWS else "oneDNN + SiLU pass"
    )
    result["paired_over_unpaired"] = statistics.median(times["paired"]) / statistics.median(
        times["unpaired"]
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,2,64,256,2048,4096", help="comma-separated row counts")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    probe = torch.empty(8, HIDDEN, dtype=torch.bfloat16)
    if not (cpu_linear.pairs_apply(probe) and cpu_linear.can_pack(probe)):
        print("this CPU does not multiply bf16 over paired weights (needs AVX-512 BF16, no AMX)")
        return 2
    keep_freed_memory()  # as the engine does: activations reuse memory instead of faulting it in
    generator = torch.Generator().manual_seed(0)
    layers = [layer_weights(generator) for _ in range(args.layers)]
    counts = [int(rows) for rows in args.rows.split(",")]
    results = [
        measure(rows, layers, args.repeats)
        for rows in tqdm(counts, desc="bench cpu_linear", unit="row count")
    ]
    print_table(
        f"SmolLM2 projections and SiLU, {args.layers} layers, {torch.get_num_threads()} "
        "threads: wall ms, median / best (GFLOP/s at the best)",
        ["rows", "paired", "unpaired", "unpaired path", "paired / unpaired"],
        [
            [
                r["rows"],
                f"{r['paired_median_ms']:.1f} / {r['paired_best_ms']:.1f} ({r['paired_gflops']:.0f})",
                f"{r['unpaired_median_ms']:.1f} / {r['unpaired_best_ms']:.1f} ({r['unpaired_gflops']:.0f})",
                r["unpaired_path"],
                f"{r['paired_over_unpaired']:.3f}x",
            ]
            for r in results
        ],
    )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"layers": args.layers, "results": results}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
