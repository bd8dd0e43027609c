"""``ragserve bench tiers``: time to first token of a question on a long document whose KV
is on the device, in the CPU tier, or in the disk tier; against the hardware it crosses."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ragserve.bench.common import (
    for_its_device,
    random_prompts,
    release_device_memory,
    time_request,
    write_json,
)
from ragserve.bench.disk_ceiling import drive_read_ceiling
from ragserve.config import EngineConfig
from ragserve.engine.engine_info import TierTraffic
from ragserve.table import print_table

if TYPE_CHECKING:
    from ragserve.llm import LLM

GIB = 2**30
# NOTE: the warm tiers (device, CPU) are timed this many times, each with a new question:
# one restore moves by a few percent from run to run, and the table gives the median.
REPEATS = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--doc-tokens", type=int, default=6000)
    parser.add_argument("--question-tokens", type=int, default=20)
    parser.add_argument(
        "--tier-gib",
        type=float,
        default=None,
        help="capacity of the CPU and disk tiers (default: the document's KV + 10%%)",
    )
    parser.add_argument(
        "--disk-dir", default=None, help="where the disk tier writes (default: $TMPDIR)"
    )
    parser.add_argument(
        "--copy-gib", type=float, default=1.0, help="size of the pinned copy reference"
    )
    parser.add_argument(
        "--skip-disk",
        action="store_true",
        help="time the device and CPU tiers only (the disk phases recompute the document "
        "and write it out: most of the run)",
    )
    parser.add_argument("--out", default="bench-results/tiers.json")


def required_model_len(args: argparse.Namespace) -> int:
    return args.doc_tokens + args.question_tokens + 2


def _auto_tier_gib(config: EngineConfig, tokens: int) -> float:
    """The document's KV from the model's config.json (2.0 GiB when there is none)."""
    path = Path(config.model or "") / "config.json"
    if not config.model or not path.is_file():
        return 2.0
    cfg = json.loads(path.read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    on_gpu = torch.cuda.is_available() and config.device != "cpu"
    itemsize = {"float32": 4, "auto": 2 if on_gpu else 4}.get(config.dtype, 2)
    blocks = -(-tokens // config.block_size)
    block_bytes = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * config.block_size * itemsize
    return blocks * block_bytes * 1.1 / GIB + 0.05


def pinned_h2d_gbps(nbytes: int, repeats: int = 5) -> float | None:
    """Best of ``repeats`` copies of a pinned host tensor to the GPU (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    del src, dst
    release_device_memory()
    return nbytes / best / 1e9


def drop_page_cache(files: list[Path]) -> str:
    """Evict the files from the page cache so the next read comes from the disk.

    Tries the global drop (needs root and a writable /proc/sys), then per-file
    ``POSIX_FADV_DONTNEED`` (works on files we own, on real file systems; a no-op on
    tmpfs). Returns the method used, or "none".
    """
    subprocess.run(["sync"], check=False)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        pass
    if not hasattr(os, "posix_fadvise"):
        return "none"
    try:
        for path in files:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    except OSError:
        return "none"
    return "fadvise"


def sequential_read_gbps(files: list[Path], threads: int) -> float:
    """Read every file whole into reused buffers, ``threads`` files at a time."""

    def read(path: Path, buffer: bytearray) -> int:
        total = 0
        view = memoryview(buffer)
        with path.open("rb", buffering=0) as handle:
            while count := handle.readinto(view):
                total += count
        return total

    size = max((p.stat().st_size for p in files), default=1)
    local = threading.local()

    def read_one(path: Path) -> int:
        if not hasattr(local, "buffer"):
            local.buffer = bytearray(min(size, 64 << 20))
        return read(path, local.buffer)

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read_one, files))
    return total / (time.perf_counter() - started) / 1e9


def filesystem_of(path: Path) -> str:
    """The mount type holding ``path`` (from /proc/mounts), e.g. ext4, xfs, overlay, tmpfs."""
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if (
                len(fields) > 2
                and str(path.resolve()).startswith(fields[1])
                and len(fields[1]) > len(best)
            ):
                best, kind = fields[1], fields[2]
    except OSError:
        pass
    return kind


class _Run:
    """The phases of the benchmark, sharing the workload and the results."""

    def __init__(self, args: argparse.Namespace, config: EngineConfig, disk_dir: Path) -> None:
        self.args = args
        self.config = config
        self.disk_dir = disk_dir
        self.results: dict[str, Any] = {"tiers": {}, "references": {}, "errors": []}
        self.doc: list[int] = []
        self.questions: list[list[int]] = []
        self.block_bytes = 0

    def _engine(self, cpu_gib: float, disk_gib: float) -> Any:
        from ragserve import LLM

        key_file = self.config.kv_encryption_key_file
        config = dataclasses.replace(
            self.config,
            kv_cpu_gib=cpu_gib,
            kv_disk_gib=disk_gib,
            kv_disk_dir=str(self.disk_dir) if disk_gib > 0 else None,
            kv_encryption_key_file=key_file if disk_gib > 0 else None,  # NOTE: disk records only
        )
        llm = LLM.from_config(config)
        engine = llm.engine
        vocab = llm.info.model_shape.vocab_size
        if not self.doc:
            self.doc = random_prompts(1, self.args.doc_tokens, vocab, seed=11)[0]
            # NOTE: one question per phase (cold, device, CPU, persist, disk), and
            # REPEATS - 1 more for each of the two warm tiers.
            self.questions = random_prompts(
                5 + 2 * (REPEATS - 1), self.args.question_tokens, vocab, seed=12
            )
            self.block_bytes = llm.info.kv_bytes_per_block
            self._check_capacity(cpu_gib or disk_gib)
            # Warm-up on unrelated tokens (Triton compiles once per process), then forget them.
            chunk = self.config.step_tokens
            warm = min(self.args.doc_tokens, 2 * chunk + chunk // 2)
        else:
            # NOTE: later engines only warm their own state; a prompt that fills no block
            # leaves nothing to be demoted into the tiers being measured.
            warm = max(1, self.config.block_size // 2)
        time_request(engine, random_prompts(1, warm, vocab, seed=13)[0], 2, request_id="warm-up")
        llm.reset_prefix_cache()
        return llm

    def _check_capacity(self, tier_gib: float) -> None:
        blocks = self.args.doc_tokens // self.config.block_size
        needed = blocks * self.block_bytes
        if needed > tier_gib * GIB:
            raise ValueError(
                f"the document's {blocks} full KV blocks need {needed / GIB:.2f} GiB but the "
                f"tiers hold {tier_gib:.2f} GiB; raise --tier-gib"
            )
        self.results["document_kv_bytes"] = needed

    def _warm_questions(self, first: int, extra: Iterator[list[int]]) -> list[list[int]]:
        """``REPEATS`` questions: ``questions[first]``, then the next ones from ``extra``."""
        return [self.questions[first], *(next(extra) for _ in range(REPEATS - 1))]

    def record(self, name: str, timings: Any, blocks_moved: int, reference: float | None) -> None:
        """One timing, or the median of repeats (all of them kept in the JSON)."""
        runs = timings if isinstance(timings, list) else [timings]
        timing = sorted(runs, key=lambda t: t.ttft_s)[len(runs) // 2]
        moved = blocks_moved * self.block_bytes
        entry: dict[str, Any] = {
            "ttft_s": timing.ttft_s,
            "ttft_s_runs": [t.ttft_s for t in runs],
            "cached_tokens": timing.num_cached_tokens,
            "blocks_moved": blocks_moved,
            "bytes_moved": moved,
            "gbps": moved / timing.ttft_s / 1e9 if moved else None,
            "reference_gbps": reference,
        }
        entry["ratio_to_reference"] = (
            entry["gbps"] / reference if entry["gbps"] and reference else None
        )
        self.results["tiers"][name] = entry
        print(
            f"{name}: TTFT {timing.ttft_s:.3f} s (median of {len(runs)}), "
            f"{timing.num_cached_tokens} tokens from cache, "
            f"{moved / GIB:.2f} GiB moved",
            flush=True,
        )
        write_json(self.args.out, self.results, quiet=True)

    def device_and_cpu(self, tier_gib: float) -> None:
        """Cold, then from the device cache, then (after evicting it) from the CPU tier; the
        warm tiers ``REPEATS`` times each, each time with a question not asked before."""
        llm = self._engine(tier_gib, 0.0)
        extra = iter(self.questions[5:])
        try:
            engine = llm.engine
            cold = time_request(engine, self.doc + self.questions[0], 1, request_id="cold")
            self.record("cold (computed)", cold, 0, None)
            device = [
                time_request(engine, self.doc + question, 1, request_id=f"device-{i}")
                for i, question in enumerate(self._warm_questions(1, extra))
            ]
            self.record("device tier", device, 0, None)
            cpu = []
            before = _traffic(llm).loaded_from_cpu
            for i, question in enumerate(self._warm_questions(2, extra)):
                llm.reset_prefix_cache()  # evicted blocks are demoted to the CPU tier
                cpu.append(time_request(engine, self.doc + question, 1, request_id=f"cpu-{i}"))
            self.record(
                "CPU tier",
                cpu,
                (_traffic(llm).loaded_from_cpu - before) // len(cpu),
                self.results["references"].get("pinned_h2d_gbps"),
            )
        finally:
            llm.close()
            del llm
            release_device_memory()

    def persist_to_disk(self, tier_gib: float) -> list[Path]:
        """A fresh engine computes the document again and writes its blocks through to disk.

        NOTE: the first engine cannot: blocks it holds in its CPU tier count as "below the
        device" and are never also written to disk.
        """
        llm = self._engine(0.0, tier_gib)
        try:
            timing = time_request(
                llm.engine, self.doc + self.questions[3], 1, request_id="persist", persist=True
            )
            self.results["cold_second_engine_s"] = timing.ttft_s
        finally:
            started = time.perf_counter()
            llm.close()  # waits for the queued disk writes
            self.results["disk_write_drain_s"] = time.perf_counter() - started
        del llm
        release_device_memory()
        return sorted(p for p in self.disk_dir.rglob("*") if p.is_file())

    def disk(self, tier_gib: float, files: list[Path]) -> None:
        """After a restart, the page cache dropped: the document's KV comes from the disk tier."""
        method = drop_page_cache(files)
        self.results["page_cache_drop"] = method
        llm = self._engine(0.0, tier_gib)
        try:
            engine = llm.engine
            disk = time_request(engine, self.doc + self.questions[4], 1, request_id="disk")
            name = "disk tier after restart" + ("" if method != "none" else " (page cache warm)")
            self.record(
                name,
                disk,
                _traffic(llm).loaded_from_disk,
                self.results["references"].get("disk_read_gbps"),
            )
        finally:
            llm.close()
            del llm
            release_device_memory()

    def disk_reference(self, files: list[Path]) -> None:
        refs = self.results["references"]
        refs["disk_filesystem"] = filesystem_of(self.disk_dir)
        refs["disk_record_files"] = len(files)
        refs["disk_record_bytes"] = sum(p.stat().st_size for p in files)
        rates = {}
        for threads in (1, 8, 32, 64):  # NOTE: 64 is the disk tier's reader count
            refs["disk_read_page_cache_drop"] = drop_page_cache(files)
            rates[threads] = sequential_read_gbps(files, threads)
        refs["disk_read_gbps_by_threads"] = rates
        direct = drive_read_ceiling(self.disk_dir, refs["disk_record_bytes"])
        refs["disk_direct_read_gbps_by_requests"] = direct
        # NOTE: the reference is the best read the drive showed, O_DIRECT or through files
        # like the tier's own: a tier is held to the drive, not to a Python read loop.
        refs["disk_read_gbps"] = max([*rates.values(), *filter(None, direct.values())])
        print(
            f"disk read of the {len(files)} record files ({refs['disk_record_bytes'] / GIB:.2f} GiB, "
            f"{refs['disk_filesystem']}, cache drop: {refs['disk_read_page_cache_drop']}): "
            + ", ".join(f"{rate:.2f} GB/s with {n} thread(s)" for n, rate in rates.items())
            + "; O_DIRECT 16 MiB reads of one file: "
            + ", ".join(
                f"{rate:.2f} GB/s with {n} in flight" if rate else f"refused ({n})"
                for n, rate in direct.items()
            ),
            flush=True,
        )


def _traffic(llm: LLM) -> TierTraffic:
    """Blocks the engine's tiers have moved so far (the engine has tiers here)."""
    traffic = llm.snapshot().tier_traffic
    assert traffic is not None
    return traffic


def _print(results: dict[str, Any], args: argparse.Namespace) -> None:
    tiers = results["tiers"]
    cold = tiers.get("cold (computed)", {}).get("ttft_s")
    rows = [
        [
            name,
            t["ttft_s"],
            t["cached_tokens"],
            cold / t["ttft_s"] if cold else None,
            t["bytes_moved"] / GIB,
            t["gbps"],
            t["reference_gbps"],
            t["ratio_to_reference"],
        ]
        for name, t in tiers.items()
    ]
    print_table(
        f"tiers: first token of a {args.question_tokens}-token question on a {args.doc_tokens}-token document",
        [
            "document KV from",
            "TTFT s",
            "cached tokens",
            "speed-up vs cold",
            "GiB moved",
            "GB/s (moved/TTFT)",
            "reference GB/s",
            "ratio to reference",
        ],
        rows,
    )
    refs = results["references"]

    def rate(key: str) -> str:
        value = refs.get(key)
        return f"{value:.2f} GB/s" if value else "not measured"

    print(
        f"references: pinned host->device copy {rate('pinned_h2d_gbps')}; "
        f"disk read {rate('disk_read_gbps')} ({refs.get('disk_filesystem', '?')}, "
        f"page cache drop before the disk row: {results.get('page_cache_drop', '?')})",
        flush=True,
    )


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    config = for_its_device(config)
    tier_gib = args.tier_gib
    if tier_gib is None:
        tier_gib = _auto_tier_gib(config, args.doc_tokens + args.question_tokens)
    root = Path(args.disk_dir) if args.disk_dir else Path(tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    if not args.skip_disk and free < tier_gib * GIB:
        raise ValueError(
            f"{root} has {free / GIB:.1f} GiB free, the disk tier needs {tier_gib:.1f} GiB"
        )
    disk_dir = Path(tempfile.mkdtemp(prefix="ragserve-bench-tiers-", dir=root))
    bench = _Run(args, config, disk_dir)
    results = bench.results
    results["workload"] = {
        "doc_tokens": args.doc_tokens,
        "question_tokens": args.question_tokens,
        "tier_gib": tier_gib,
        "disk_dir": str(disk_dir),
        "max_num_batched_tokens": config.max_num_batched_tokens,
    }
    try:
        results["references"]["pinned_h2d_gbps"] = pinned_h2d_gbps(int(args.copy_gib * GIB))
        files: list[Path] = []
        for name, phase in (
            ("device and CPU tiers", lambda: bench.device_and_cpu(tier_gib)),
            ("persist to disk", lambda: files.extend(bench.persist_to_disk(tier_gib))),
            ("disk reference", lambda: bench.disk_reference(files)),
            ("disk tier", lambda: bench.disk(tier_gib, files)),
        ):
            if name != "device and CPU tiers" and (not bench.doc or args.skip_disk):
                break  # the first engine did not start (nothing else can run), or no disk
            try:
                phase()
                # NOTE: after the phase returns, so its engine is unreferenced: the next
                # engine sizes its KV cache from the device's free memory.
                release_device_memory()
            except (
                Exception
            ) as exc:  # NOTE: keep the other tiers' figures; the JSON says what failed.
                if isinstance(exc, ValueError) and not bench.results["tiers"]:
                    raise
                traceback.print_exc()
                results["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
                release_device_memory()
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    # The disk row was measured before its reference; fill in its ratio now.
    refs = results["references"]
    for name, entry in results["tiers"].items():
        if name.startswith("disk") and entry["gbps"] and refs.get("disk_read_gbps"):
            entry["reference_gbps"] = refs["disk_read_gbps"]
            entry["ratio_to_reference"] = entry["gbps"] / refs["disk_read_gbps"]
    _print(results, args)
    write_json(args.out, results)
    return 1 if results["errors"] else 0
