"""GPU check and microbenchmark of the FP8 linear (``kernels/fp8_linear.py``).

Run ``python -m kernels.bench_fp8_linear [--rows 1,16,256,4096] [--json PATH]`` on a CUDA
device of compute capability 8.9 or more. For each Llama-3.1-8B projection (packed qkv,
o, packed gate/up, down) and each row count it times bf16 ``F.linear`` against the FP8
path (per-token activation quantization plus ``torch._scaled_mm``), both replayed from CUDA
graphs, and checks the FP8 output against the float32 reference. At one row a linear is
a weight read: the TB/s column is weight bytes over time (H200 peak: 4.8 TB/s).
Exits 1 when any output is off the reference by more than bf16 rounding allows.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from kernels.fp8_linear import (
    fp8_matmul_reference,
    fp8_matmul_scaled_mm,
    quantize_rows,
    scaled_mm_usable,
)

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


def bench(name: str, k: int, n: int, rows: int) -> dict[str, object]:
    device = torch.device("cuda")
    weight = torch.randn(n, k, device=device) * 0.02
    x = torch.randn(rows, k, device=device).to(torch.bfloat16)
    codes, scale = quantize_rows(weight)
    weight_bf16 = weight.to(torch.bfloat16)
    del weight
    got = fp8_matmul_scaled_mm(x, codes, scale).float()
    want = fp8_matmul_reference(x, codes, scale)
    error = float((got - want).abs().max() / want.abs().max())
    bf16_us = time_us(lambda: F.linear(x, weight_bf16))
    fp8_us = time_us(lambda: fp8_matmul_scaled_mm(x, codes, scale))
    fp8_bytes = codes.numel() + 4 * scale.numel()
    return {
        "linear": name,
        "k": k,
        "n": n,
        "rows": rows,
        "bf16_us": bf16_us,
        "fp8_us": fp8_us,
        "speedup": bf16_us / fp8_us,
        "bf16_tbps": 2 * codes.numel() / bf16_us / 1e6,
        "fp8_tbps": fp8_bytes / fp8_us / 1e6,
        "max_rel_error": error,
        "ok": error <= TOLERANCE,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", default="1,16,256,4096", help="row counts (tokens), comma-separated"
    )
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    device = torch.device("cuda")
    if not scaled_mm_usable(device, torch.bfloat16, 4096, 4096):
        print("needs a CUDA device of compute capability >= 8.9 (torch._scaled_mm, row-wise)")
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    header = f"{'linear':<13}{'K':>6}{'N':>7}{'rows':>6}{'bf16 us':>10}{'fp8 us':>9}"
    print(header + f"{'x':>7}{'bf16 TB/s':>11}{'fp8 TB/s':>10}{'max rel err':>13}")
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name, k, n in PROJECTIONS:
            row = bench(name, k, n, rows)
            results.append(row)
            print(
                f"{name:<13}{k:>6}{n:>7}{rows:>6}{row['bf16_us']:>10.1f}{row['fp8_us']:>9.1f}"
                f"{row['speedup']:>7.2f}{row['bf16_tbps']:>11.2f}{row['fp8_tbps']:>10.2f}"
                f"{row['max_rel_error']:>13.2e}{'' if row['ok'] else '  OFF THE REFERENCE'}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    return 0 if all(row["ok"] for row in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
