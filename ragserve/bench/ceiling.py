"""The hardware ceilings behind the floors: matmul TFLOP/s and device copy GB/s, over a
short burst and over a sustained run (with the SM clock and power draw where NVML reads them).

A GPU under a power cap slows its clock a few seconds into heavy work, so a long prefill
runs below the rate a short burst measures; this benchmark shows by how much.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ragserve.bench.common import machine_description, write_json
from ragserve.config import EngineConfig
from ragserve.devices import resolve_device, resolve_dtype
from ragserve.table import print_table


def _matmul_shape(text: str) -> tuple[int, int, int]:
    try:
        m, k, n = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected M,K,N (three integers), got {text!r}") from None
    if min(m, k, n) < 1:
        raise argparse.ArgumentTypeError(f"M, K and N must be >= 1, got {text!r}")
    return m, k, n


def _positive(kind: type) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
        return value

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--matmul", type=_matmul_shape, default=(32768, 4096, 28672),
        help="M,K,N of the timed matmul (default: a 32k-token chunk through Llama-3.1-8B's "
             "gate/up projection)",
    )  # fmt: skip
    parser.add_argument("--burst-seconds", type=_positive(float), default=0.1)
    parser.add_argument(
        "--seconds", type=_positive(float), default=8.0, help="length of each sustained run"
    )
    parser.add_argument(
        "--copy-mib", type=_positive(int), default=2048, help="size of the copied tensor"
    )
    parser.add_argument("--out", default="bench-results/ceiling.json")


def run_for(step: Callable[[], object], seconds: float, device: torch.device) -> tuple[int, float]:
    """Call ``step`` back to back for about ``seconds`` (after one untimed call).

    Returns (calls, elapsed seconds); the device is synchronised after every call, which
    costs microseconds against milliseconds of work.
    """

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    step()
    sync()
    calls = 0
    started = time.perf_counter()
    while True:
        step()
        sync()
        calls += 1
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return calls, elapsed


class ClockSampler:
    """Samples the SM clock (MHz) and power draw (W) every ``interval`` s in a thread.

    Reads NVML through torch; where that is missing (no ``pynvml``, not a CUDA device)
    ``available`` is False and nothing is sampled.
    """

    def __init__(self, device: torch.device, interval: float = 0.1) -> None:
        self.device = device
        self.interval = interval
        self.clocks_mhz: list[float] = []
        self.power_w: list[float] = []
        self.available = device.type == "cuda" and self._read() is not None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _read(self) -> tuple[float, float] | None:
        try:
            return float(torch.cuda.clock_rate(self.device)), torch.cuda.power_draw(
                self.device
            ) / 1e3
        except Exception:  # NOTE: no pynvml, no driver, or NVML's own error classes
            return None

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            reading = self._read()
            if reading is not None:
                self.clocks_mhz.append(reading[0])
                self.power_w.append(reading[1])

    def __enter__(self) -> ClockSampler:
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def summary(self) -> dict[str, float | None]:
        return {
            "sm_clock_mhz_median": statistics.median(self.clocks_mhz) if self.clocks_mhz else None,
            "sm_clock_mhz_min": min(self.clocks_mhz) if self.clocks_mhz else None,
            "power_w_mean": statistics.fmean(self.power_w) if self.power_w else None,
        }


def measure(
    name: str,
    step: Callable[[], object],
    work: float,
    args: argparse.Namespace,
    device: torch.device,
) -> dict[str, Any]:
    """``work`` per call of ``step``, as a rate over a burst and over a sustained run."""
    calls, elapsed = run_for(step, args.burst_seconds, device)
    burst = work * calls / elapsed
    with ClockSampler(device) as sampler:
        calls, elapsed = run_for(step, args.seconds, device)
    sustained = work * calls / elapsed
    print(f"{name}: {burst:.4g} in a burst, {sustained:.4g} sustained", flush=True)
    return {
        "burst": burst,
        "sustained": sustained,
        "sustained_seconds": elapsed,
        **sampler.summary(),
    }


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    m, k, n = args.matmul
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, generator=generator, device=device, dtype=dtype)
    weight = torch.randn(n, k, generator=generator, device=device, dtype=dtype) * 0.01
    source = torch.empty(args.copy_mib << 20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    results: dict[str, Any] = {
        "machine": machine_description(),
        "torch": torch.__version__,
        "workload": {"matmul": [m, k, n], "dtype": str(dtype), "device": str(device),
                     "burst_seconds": args.burst_seconds, "seconds": args.seconds,
                     "copy_mib": args.copy_mib},
    }  # fmt: skip
    with torch.inference_mode():
        results["matmul_tflops"] = measure(
            "matmul TFLOP/s", lambda: torch.nn.functional.linear(x, weight), 2.0 * m * k * n / 1e12,
            args, device,
        )  # fmt: skip
        # NOTE: a copy reads and writes every byte: both count, as in the floors' 4.25 TB/s.
        results["copy_gbps"] = measure(
            "copy GB/s", lambda: target.copy_(source), 2.0 * source.numel() / 1e9, args, device
        )
    rows = [
        [f"{dtype} matmul {m}x{k}x{n}, TFLOP/s", results["matmul_tflops"]],
        [f"device copy of {args.copy_mib} MiB (read + write), GB/s", results["copy_gbps"]],
    ]
    print_table(
        f"ceilings on {results['machine']}: a {args.burst_seconds:g} s burst, then {args.seconds:g} s "
        "sustained (SM clock and power sampled during the sustained run)",
        ["figure", "burst", "sustained", "sustained / burst", "SM clock MHz (median, min)", "power W"],
        [[label, r["burst"], r["sustained"], r["sustained"] / r["burst"],
          _clock(r), r["power_w_mean"]] for label, r in rows],
    )  # fmt: skip
    write_json(args.out, results)
    return 0


def _clock(result: dict[str, Any]) -> str | None:
    if result["sm_clock_mhz_median"] is None:
        return None
    return f"{result['sm_clock_mhz_median']:.0f}, {result['sm_clock_mhz_min']:.0f}"
