"""``ragserve bench tiers``: time to first token on a long document from each KV tier."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ragserve.bench.common import print_table, random_prompts, write_json
from ragserve.config import EngineConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--doc-tokens", type=int, default=6000)
    parser.add_argument("--question-tokens", type=int, default=20)
    parser.add_argument("--tier-gib", type=float, default=2.0, help="capacity of the CPU and disk tiers")
    parser.add_argument("--out", default="bench-results/tiers.json")


def _ttft(llm: Any, prompt: list[int]) -> tuple[float, int]:
    from ragserve import SamplingParams

    started = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
    return time.perf_counter() - started, out.num_cached_tokens


def _drop_page_cache() -> bool:
    """Make the next disk read come from the disk (needs root; False if not allowed)."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _plain_read_gbps(files: list[Path]) -> float:
    """Sequential read of the same record files with plain Python file reads."""
    started = time.perf_counter()
    total = 0
    for path in files:
        with path.open("rb") as handle:
            total += len(handle.read())
    return total / (time.perf_counter() - started) / 1e9


def run(args: argparse.Namespace, config: EngineConfig) -> int:
    from ragserve import LLM

    disk_dir = tempfile.mkdtemp(prefix="ragserve-bench-tiers-")
    config = dataclasses.replace(
        config, kv_cpu_gib=args.tier_gib, kv_disk_gib=args.tier_gib, kv_disk_dir=disk_dir
    )
    llm = LLM.from_config(config)
    engine = llm.engine
    vocab = engine.loaded.model.shape.vocab_size
    doc = random_prompts(1, args.doc_tokens, vocab, seed=11)[0]
    questions = random_prompts(4, args.question_tokens, vocab, seed=12)

    rows: list[list[Any]] = []
    cold, _ = _ttft(llm, doc + questions[0])
    rows.append(["cold (computed)", cold, 0, 1.0])
    device, hit = _ttft(llm, doc + questions[1])
    rows.append(["device tier", device, hit, cold / device])
    # Pin-and-persist writes the document through to disk; reset pushes it to the CPU tier.
    engine.pin_prefix("bench-doc", doc)
    engine.unpin_prefix("bench-doc")
    llm.reset_prefix_cache()
    cpu, hit = _ttft(llm, doc + questions[2])
    rows.append(["CPU tier", cpu, hit, cold / cpu])
    llm.close()
    del llm, engine

    records = [p for p in Path(disk_dir).rglob("*") if p.is_file()]
    dropped = _drop_page_cache()
    restarted = LLM.from_config(dataclasses.replace(config, kv_cpu_gib=0.0))
    disk, hit = _ttft(restarted, doc + questions[3])
    rows.append([f"disk tier after restart{'' if dropped else ' (page cache warm)'}", disk, hit, cold / disk])
    tiers = restarted.engine.tiers
    assert tiers is not None
    loaded_bytes = tiers.traffic.loaded_from_disk * restarted.engine.kv_spec.bytes_per_block
    restore = loaded_bytes / tiers.traffic.load_seconds / 1e9
    restarted.close()
    _drop_page_cache()
    plain = _plain_read_gbps(records)

    print_table(
        f"tiers: first token of a {args.question_tokens}-token question on a {args.doc_tokens}-token document",
        ["document KV from", "TTFT s", "cached tokens", "speed-up vs cold"],
        rows,
    )
    print(f"\ndisk restore into the device cache {restore:.2f} GB/s (verified), plain sequential read "
          f"{plain:.2f} GB/s; page cache dropped: {dropped}")
    write_json(args.out, {
        "workload": {"doc_tokens": args.doc_tokens, "question_tokens": args.question_tokens},
        "ttft_s": {row[0]: row[1] for row in rows},
        "speedup_vs_cold": {row[0]: row[3] for row in rows},
        "restore_gbps": restore, "plain_read_gbps": plain, "page_cache_dropped": dropped,
    })
    return 0
