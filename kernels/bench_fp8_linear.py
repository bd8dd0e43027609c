"""GPU check and microbenchmark of the FP8 linear (``kernels/fp8_linear.py``).

Run ``python -m kernels.bench_fp8_linear [--rows 1,4,16,64,256,4096] [--sweep] [--json PATH]``
on a CUDA device of compute capability 8.9 or more. For each Llama-3.1-8B projection
(packed qkv, o, packed gate/up, down) and each row count it times, all replayed from CUDA
graphs:

- ``bf16``: ``F.linear`` on bf16 weights;
- ``fp8``: the path the layer dispatches to (:func:`kernels.fp8_linear.fp8_linear_cuda`):
  ``gemv`` (weight-only, up to ``WEIGHT_ONLY_MAX_ROWS`` rows) or ``q+mm``;
- its parts: ``quant`` (the fused Triton quantizer), ``q-torch`` (the five torch ops it
  replaces), ``mm`` (``torch._scaled_mm`` alone), ``mm-fast`` (the same with
  ``use_fast_accum``, to see what Hopper's two-level FP8 accumulation costs) and ``gemv``
  (the weight-only kernel alone, up to its row limit, whichever path dispatch takes);
- ``TB/s``: FP8 weight bytes over the dispatched time (H200 peak: 4.8 TB/s).

It checks the dispatched output against its float32 reference and the fused quantizer
against ``quantize_rows`` bit for bit; exits 1 when either is off. ``--sweep`` also times
the GEMV's alternative tile shapes per shape and row count and prints the fastest.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from kernels.fp8_linear import (
    WEIGHT_ONLY_MAX_ROWS,
    fp8_linear_cuda,
    fp8_matmul_reference,
    quantize_rows,
    scaled_mm_quantized,
    scaled_mm_usable,
)
from kernels.triton_fp8_gemv import (
    MAX_FMA_ROWS,
    MAX_ROWS,
    fp8_gemv,
    fp8_gemv_reference,
    gemv_config,
)
from kernels.triton_fp8_quant import quantize_rows_triton

# (name, in_features, out_features) of Llama-3.1-8B's projections, packed as ragserve packs them.
PROJECTIONS = (
    ("qkv_proj", 4096, 6144),
    ("o_proj", 4096, 4096),
    ("gate_up_proj", 4096, 28672),
    ("down_proj", 14336, 4096),
)
# The FP8 output may differ from the float32 reference by bf16 rounding (2^-8 relative)
# and float32 summation order; relative to the output's largest magnitude.
TOLERANCE = 2.0**-7


def time_us(fn: Callable[[], object]) -> float:
    return float(do_bench_cudagraph(fn, rep=50)) * 1e3


def sweep_configs(rows: int) -> list[tuple[int, int, int, int, int]]:
    """GEMV tile shapes worth timing at ``rows`` rows (the form follows ``gemv_config``)."""
    if rows <= MAX_FMA_ROWS:
        block_m = gemv_config(rows, 1)[0]
        return [
            (block_m, block_n, tile // block_n, warps, 1)
            for block_n, tile, warps in itertools.product((4, 8, 16, 32), (8192, 16384), (4, 8))
        ]
    block_m = gemv_config(rows, 1)[0]
    return [
        (block_m, block_n, block_k, 4, stages)
        for block_n, block_k, stages in itertools.product((16, 32), (128, 256, 512), (3, 5))
    ]


def sweep(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> tuple[str, float]:
    """The fastest GEMV config for these operands (that matches the reference) and its time."""
    want = fp8_gemv_reference(x, codes, scale)
    best: tuple[str, float] = ("", float("inf"))
    for config in sweep_configs(x.shape[0]):

        def run(config: tuple[int, int, int, int, int] = config) -> torch.Tensor:
            return fp8_gemv(x, codes, scale, config=config)

        try:
            us = time_us(run)
        except Exception as exc:  # NOTE: a tile that does not fit (shared memory) is skipped
            print(f"  skipped {config}: {type(exc).__name__}")
            continue
        error = (run().float() - want).abs().max() / want.abs().max()
        if error > TOLERANCE:
            print(f"  {config} is off the reference by {float(error):.2e}")
            continue
        if us < best[1]:
            best = (str(config), us)
    return best


def bench(name: str, k: int, n: int, rows: int, do_sweep: bool) -> dict[str, object]:
    device = torch.device("cuda")
    weight = torch.randn(n, k, device=device) * 0.02
    x = torch.randn(rows, k, device=device).to(torch.bfloat16)
    codes, scale = quantize_rows(weight)
    weight_bf16 = weight.to(torch.bfloat16)
    del weight
    weight_only = rows <= WEIGHT_ONLY_MAX_ROWS
    reference = fp8_gemv_reference if weight_only else fp8_matmul_reference
    got = fp8_linear_cuda(x, codes, scale).float()
    want = reference(x, codes, scale)
    error = float((got - want).abs().max() / want.abs().max())
    x_codes, x_scale = quantize_rows_triton(x)
    want_codes, want_scale = quantize_rows(x)
    quant_exact = torch.equal(x_scale, want_scale) and torch.equal(
        x_codes.view(torch.uint8), want_codes.view(torch.uint8)
    )
    fp8_us = time_us(lambda: fp8_linear_cuda(x, codes, scale))
    fp8_bytes = codes.numel() + 4 * scale.numel()
    row: dict[str, object] = {
        "linear": name,
        "k": k,
        "n": n,
        "rows": rows,
        "path": "gemv" if weight_only else "q+mm",
        "bf16_us": time_us(lambda: F.linear(x, weight_bf16)),
        "fp8_us": fp8_us,
        "quant_us": time_us(lambda: quantize_rows_triton(x)),
        "quant_torch_us": time_us(lambda: quantize_rows(x)),
        "mm_us": time_us(
            lambda: scaled_mm_quantized(x_codes, x_scale, codes, scale, torch.bfloat16)
        ),
        "mm_fast_us": time_us(
            lambda: torch._scaled_mm(
                x_codes,
                codes.t(),
                scale_a=x_scale,
                scale_b=scale.view(1, -1),
                out_dtype=torch.bfloat16,
                use_fast_accum=True,
            )
        ),
        "gemv_us": time_us(lambda: fp8_gemv(x, codes, scale)) if rows <= MAX_ROWS else None,
        "fp8_tbps": fp8_bytes / fp8_us / 1e6,
        "max_rel_error": error,
        "quant_bit_exact": quant_exact,
        "ok": error <= TOLERANCE and quant_exact,
    }
    if do_sweep and rows <= MAX_ROWS:
        row["sweep_best"], row["sweep_best_us"] = sweep(x, codes, scale)
    return row


def _us(value: object) -> str:
    return f"{value:.1f}" if isinstance(value, float) else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", default="1,4,16,64,256,4096", help="row counts (tokens), comma-separated"
    )
    parser.add_argument("--sweep", action="store_true", help="also time other GEMV tiles")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    device = torch.device("cuda")
    if not scaled_mm_usable(device, torch.bfloat16, 4096, 4096):
        print("needs a CUDA device of compute capability >= 8.9 (torch._scaled_mm, row-wise)")
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, microseconds")
    columns = ("bf16", "fp8", "x", "quant", "q-torch", "mm", "mm-fast", "gemv", "TB/s")
    header = f"{'linear':<13}{'K':>6}{'N':>7}{'rows':>6}{'path':>6}"
    print(header + "".join(f"{c:>9}" for c in columns) + f"{'max rel err':>13}")
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name, k, n in PROJECTIONS:
            row = bench(name, k, n, rows, args.sweep)
            results.append(row)
            times = [row[key] for key in ("bf16_us", "fp8_us")]
            speedup = f"{row['bf16_us'] / row['fp8_us']:.2f}"  # type: ignore[operator]
            parts = [row[key] for key in ("quant_us", "quant_torch_us", "mm_us", "mm_fast_us")]
            cells = [_us(v) for v in times] + [speedup] + [_us(v) for v in parts]
            cells += [_us(row["gemv_us"]), f"{row['fp8_tbps']:.2f}"]
            status = "" if row["ok"] else "  OFF THE REFERENCE"
            if not row["quant_bit_exact"]:
                status += "  QUANTIZER NOT BIT-EXACT"
            print(
                f"{name:<13}{k:>6}{n:>7}{rows:>6}{row['path']:>6}"
                + "".join(f"{c:>9}" for c in cells)
                + f"{row['max_rel_error']:>13.2e}{status}",
                flush=True,
            )
            if "sweep_best" in row:
                print(f"  fastest GEMV tile {row['sweep_best']}: {_us(row['sweep_best_us'])} us")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    return 0 if all(row["ok"] for row in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
