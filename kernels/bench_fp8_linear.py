"""GPU check and microbenchmark of the FP8 linear (``kernels/fp8_linear.py``).

Run ``python -m kernels.bench_fp8_linear [--rows 1,4,16,64,256,4096] [--sweep] [--json PATH]``
on a CUDA device of compute capability 8.9 or more. For each Llama-3.1-8B projection
(packed qkv, o, packed gate/up, down) and each row count it times, all replayed from CUDA
graphs:

- ``bf16``: ``F.linear`` on bf16 weights;
- ``fp8``: the path the layer dispatches to (:func:`kernels.fp8_linear.fp8_linear_cuda`):
  ``gemv`` (weight-only, up to ``WEIGHT_ONLY_MAX_ROWS`` rows) or ``q+mm``;
- its parts: ``quant`` (the fused Triton quantizer), ``q-torch`` (the five torch ops it
  replaces), ``mm`` (``torch._scaled_mm`` alone, with the engine's fast accumulation), ``mm-exact``
  (the same with float32 accumulation, to see what the fast form saves) and ``gemv``
  (the weight-only kernel alone, up to its row limit, whichever path dispatch takes);
- ``TB/s``: FP8 weight bytes over the dispatched time (H200 peak: 4.8 TB/s).

It checks the dispatched output against its float32 reference and the fused quantizer
against ``quantize_rows`` bit for bit; exits 1 when either is off. ``--sweep`` also times
the GEMV's alternative tile shapes per shape and row count and prints the fastest.

``--fused-ops`` times instead the kernels that quantize the activation where it is made
(``kernels/fused_fp8_ops.py``) against the unfused pair they replace, at the 8B's widths
(rows default 256,4096,16384): ``add_rms_norm`` (with the residual, hidden 4096) then
``quantize_rows_triton`` against ``add_rms_norm_quant``, and ``silu_and_mul`` (intermediate
14336) then ``quantize_rows_triton`` against ``silu_and_mul_quant`` (also forced into its
two-pass loop over 4096-wide blocks, ``loop``). Each time is the median over 30 replays of a
CUDA graph of 20 calls, by CUDA events, after a warm-up. It checks every fused output bit
for bit against the unfused one; exits 1 when one is off or failed to compile.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from kernels.fp8_linear import (
    ACCUMULATION_TOLERANCE,
    WEIGHT_ONLY_MAX_ROWS,
    fp8_linear_cuda,
    fp8_matmul_reference,
    product_magnitudes,
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
# and summation order; relative to the output (the GEMV sweep: to its largest magnitude).
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
    # NOTE: the bound of kernels/fp8_linear.py: bf16 rounding of the output, plus the fast
    # FP8 accumulation's error relative to the summed magnitudes of the products.
    magnitudes = product_magnitudes(x, codes, scale, quantized=not weight_only)
    within = bool(
        ((got - want).abs() <= TOLERANCE * want.abs() + ACCUMULATION_TOLERANCE * magnitudes).all()
    )
    accumulation_error = float(((got - want).abs() / magnitudes.clamp_min(1e-30)).max())
    del magnitudes
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
        "mm_exact_us": time_us(
            lambda: torch._scaled_mm(
                x_codes,
                codes.t(),
                scale_a=x_scale,
                scale_b=scale.view(1, -1),
                out_dtype=torch.bfloat16,
                use_fast_accum=False,
            )
        ),
        "gemv_us": time_us(lambda: fp8_gemv(x, codes, scale)) if rows <= MAX_ROWS else None,
        "fp8_tbps": fp8_bytes / fp8_us / 1e6,
        "max_rel_error": error,
        "max_error_over_magnitudes": accumulation_error,
        "quant_bit_exact": quant_exact,
        "ok": within and quant_exact,
    }
    if do_sweep and rows <= MAX_ROWS:
        row["sweep_best"], row["sweep_best_us"] = sweep(x, codes, scale)
    return row


def graph_time_us(fn: Callable[[], object], calls: int = 20, replays: int = 30) -> float:
    """Median µs of one ``fn()`` call: CUDA events around replays of a graph of ``calls``
    calls (no launch overhead in the time), after a warm-up."""
    for _ in range(3):
        fn()  # compiles, and warms the caches
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


def _same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(got[1], want[1]) and torch.equal(
        got[0].view(torch.uint8), want[0].view(torch.uint8)
    )


def bench_fused_ops(rows: int, device: torch.device) -> list[dict[str, object]]:
    """The norm and SiLU rows of ``--fused-ops`` at ``rows`` rows (errors reported, not raised)."""
    from kernels import fused_fp8_ops, fused_ops

    hidden, intermediate = 4096, 14336
    x = torch.randn(rows, hidden, device=device).to(torch.bfloat16)
    residual = torch.randn(rows, hidden, device=device).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(torch.bfloat16)
    gate_up = (3 * torch.randn(rows, 2 * intermediate, device=device)).to(torch.bfloat16)

    def norm_unfused() -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_rows_triton(fused_ops.rms_norm(x, weight, 1e-5, residual=residual))

    def norm_fused() -> tuple[torch.Tensor, torch.Tensor]:
        return fused_fp8_ops.add_rms_norm_quant(x, weight, 1e-5, residual=residual)

    def silu_unfused() -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_rows_triton(fused_ops.silu_and_mul(gate_up))

    def silu_fused() -> tuple[torch.Tensor, torch.Tensor]:
        return fused_fp8_ops.silu_and_mul_quant(gate_up)

    def silu_loop() -> tuple[torch.Tensor, torch.Tensor]:
        return fused_fp8_ops.silu_and_mul_quant(gate_up, block=fused_fp8_ops.SILU_LOOP_BLOCK)

    cases = (
        ("add_rms_norm", hidden, norm_unfused, {"fused": norm_fused}),
        ("silu_and_mul", intermediate, silu_unfused, {"fused": silu_fused, "loop": silu_loop}),
    )
    results: list[dict[str, object]] = []
    for name, width, unfused, variants in cases:
        errors: list[str] = []
        row: dict[str, object] = {"op": name, "width": width, "rows": rows, "errors": errors}
        start = residual.clone()
        try:
            want = unfused()
            row["unfused_us"] = graph_time_us(unfused)
        except Exception as exc:  # NOTE: a kernel that fails to compile is reported
            errors.append(f"unfused: {type(exc).__name__}: {exc}"[:300])
            want = None
        for variant, fn in variants.items():
            residual.copy_(start)  # the norm adds into it: both sides start from one stream
            try:
                got = fn()
                row[f"{variant}_exact"] = want is not None and _same(got, want)
                row[f"{variant}_us"] = graph_time_us(fn)
            except Exception as exc:
                errors.append(f"{variant}: {type(exc).__name__}: {exc}"[:300])
        residual.copy_(start)
        results.append(row)
    return results


def fused_ops_main(rows_list: list[int], json_path: str | None) -> int:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, microseconds")
    print(f"{'op':<14}{'width':>7}{'rows':>7}{'unfused':>10}{'fused':>10}{'x':>7}{'loop':>10}")
    results = []
    ok = True
    for rows in rows_list:
        for row in bench_fused_ops(rows, torch.device("cuda")):
            results.append(row)
            unfused, fused = row.get("unfused_us"), row.get("fused_us")
            speedup = (
                f"{unfused / fused:.2f}"
                if isinstance(unfused, float) and isinstance(fused, float)
                else "-"
            )
            exact = all(row[key] for key in row if key.endswith("_exact"))
            status = "" if exact else "  NOT BIT-EXACT"
            for error in cast(list[str], row["errors"]):
                status += f"\n  {error}"
            ok = ok and exact and not row["errors"]
            print(
                f"{row['op']:<14}{row['width']:>7}{rows:>7}{_us(unfused):>10}{_us(fused):>10}"
                f"{speedup:>7}{_us(row.get('loop_us')):>10}{status}",
                flush=True,
            )
    if json_path:
        with open(json_path, "w") as handle:
            json.dump(results, handle, indent=2)
    return 0 if ok else 1


def _us(value: object) -> str:
    return f"{value:.1f}" if isinstance(value, float) else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows",
        default=None,
        help="row counts (tokens), comma-separated (default 1,4,16,64,256,4096; with "
        "--fused-ops 256,4096,16384)",
    )
    parser.add_argument("--sweep", action="store_true", help="also time other GEMV tiles")
    parser.add_argument(
        "--fused-ops", action="store_true", help="time the fused norm/SiLU + quantize kernels"
    )
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    device = torch.device("cuda")
    if not scaled_mm_usable(device, torch.bfloat16, 4096, 4096):
        print("needs a CUDA device of compute capability >= 8.9 (torch._scaled_mm, row-wise)")
        return 2
    if args.fused_ops:
        rows = args.rows or "256,4096,16384"
        return fused_ops_main([int(r) for r in rows.split(",")], args.json)
    args.rows = args.rows or "1,4,16,64,256,4096"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, microseconds")
    columns = ("bf16", "fp8", "x", "quant", "q-torch", "mm", "mm-exact", "gemv", "TB/s")
    header = f"{'linear':<13}{'K':>6}{'N':>7}{'rows':>6}{'path':>6}"
    print(header + "".join(f"{c:>9}" for c in columns) + f"{'max rel err':>13}")
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name, k, n in PROJECTIONS:
            row = bench(name, k, n, rows, args.sweep)
            results.append(row)
            times = [row[key] for key in ("bf16_us", "fp8_us")]
            speedup = f"{row['bf16_us'] / row['fp8_us']:.2f}"  # type: ignore[operator]
            parts = [row[key] for key in ("quant_us", "quant_torch_us", "mm_us", "mm_exact_us")]
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
