"""``ragserve bench prefix``: questions on one long document, with and without prefix caching.

Here ``--dtype auto`` (the default) means bfloat16, on the CPU too (vLLM's CPU build also
serves bf16 by default); pass ``--dtype float32`` for the correctness dtype.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

from ragserve.bench.common import (
    int_at_least,
    load_transformers_model,
    random_prompts,
    succeeded,
    time_request,
    transformers_generate,
    write_json,
)
from ragserve.table import print_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--doc-tokens", type=int, default=4096)
    # NOTE: questions 2-4 time a warm first token, and 5-7 one without the document.
    parser.add_argument("--num-questions", type=int_at_least(5), default=8)
    parser.add_argument("--question-tokens", type=int, default=20)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", default="bench-results/prefix.json")


def _timed(fn: Any, *args: Any) -> float:
    started = time.perf_counter()
    fn(*args)
    return time.perf_counter() - started


def hashing_ms_per_1k_tokens(num_tokens: int = 131072, block_size: int = 16) -> dict[str, float]:
    """Cost of hashing a long prompt's blocks (best of five), in ms per 1k tokens: the
    first time, and again through a memo that has seen them (a new question on the same
    document, as the engine hashes it)."""
    from kvstore.hashing import ROOT_PARENT, BlockHashMemo, hash_full_blocks, make_salt

    salt = make_salt("bench", block_size, "float32")
    tokens = list(range(num_tokens))
    memo = BlockHashMemo()
    hash_full_blocks(salt, tokens, block_size, ROOT_PARENT, 0, memo)
    first = min(_timed(hash_full_blocks, salt, tokens, block_size) for _ in range(5))
    again = min(
        _timed(hash_full_blocks, salt, tokens, block_size, ROOT_PARENT, 0, memo) for _ in range(5)
    )
    per_1k = 1000 / (num_tokens / 1000)
    return {"first": first * per_1k, "again": again * per_1k}


def run(args: argparse.Namespace, config: Any) -> int:
    from ragserve import LLM, SamplingParams

    if config.dtype == "auto":
        config = dataclasses.replace(config, dtype="bfloat16")
    cached = LLM.from_config(config)
    engine, info = cached.engine, cached.info
    vocab = info.model_shape.vocab_size
    doc = random_prompts(1, args.doc_tokens, vocab, seed=7)[0]
    questions = random_prompts(args.num_questions, args.question_tokens, vocab, seed=8)
    prompts = [doc + q for q in questions]
    answer = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    first_token = SamplingParams(temperature=0.0, max_tokens=1)

    def sequential(llm: Any) -> float:
        return _timed(
            lambda: [succeeded(llm.generate([p], answer, use_tqdm=False)) for p in prompts]
        )

    def concurrent(llm: Any) -> float:
        return _timed(lambda: succeeded(llm.generate(prompts, answer, use_tqdm=False)))

    results: dict[str, Any] = {"workload": {k: v for k, v in vars(args).items() if k != "func"}}

    def first_token_time(prompt: list[int]) -> float:
        return _timed(cached.generate, [prompt], first_token, False)

    cold_ttft = first_token_time(prompts[0])
    warm_ttft = min(first_token_time(p) for p in prompts[1:4])
    question_only = min(first_token_time(q) for q in questions[4:7])
    seq_cached = sequential(cached)
    conc_cached = concurrent(cached)
    per_question = seq_cached / len(prompts)
    # One cached question through the step loop, for where its time goes.
    split = min(
        (
            time_request(engine, p, args.output_len, request_id=f"split-{i}")
            for i, p in enumerate(prompts[:3])
        ),
        key=lambda timing: timing.token_times_s[-1],
    )
    decode_ms = split.decode_ms_per_token or 0.0

    plain = LLM.from_config(dataclasses.replace(config, enable_prefix_caching=False))
    seq_plain = sequential(plain)
    conc_plain = concurrent(plain)
    del plain

    rows = [
        ["ragserve, prefix caching", seq_cached, conc_cached, per_question],
        ["ragserve, no caching", seq_plain, conc_plain, seq_plain / len(prompts)],
    ]
    results["ragserve_cached"] = {
        "sequential_s": seq_cached,
        "concurrent_s": conc_cached,
        "per_question_s": per_question,
        "cold_ttft_s": cold_ttft,
        "warm_ttft_s": warm_ttft,
        "question_only_ttft_s": question_only,
        "one_question_s": split.token_times_s[-1],
        "one_question_ttft_s": split.ttft_s,
        "one_question_decode_ms_per_token": decode_ms,
    }
    results["ragserve_uncached"] = {"sequential_s": seq_plain, "concurrent_s": conc_plain}
    if not args.skip_transformers:
        hf = load_transformers_model(config.model, config.load_format, info.dtype, info.device)
        hf_seconds = sum(transformers_generate(hf, [p], args.output_len, 1, 0)[0] for p in prompts)
        rows.append(["transformers generate", hf_seconds, float("nan"), hf_seconds / len(prompts)])
        results["transformers"] = {"sequential_s": hf_seconds}
    results["speedup_cached_vs_uncached_sequential"] = seq_plain / seq_cached
    results["speedup_cached_vs_uncached_concurrent"] = conc_plain / conc_cached
    results["warm_ttft_over_question_only"] = warm_ttft / question_only
    hashing = hashing_ms_per_1k_tokens()
    results["hash_ms_per_1k_tokens_at_128k"] = hashing
    results["dtype"] = str(info.dtype).removeprefix("torch.")
    print_table(
        f"prefix ({results['dtype']}): {args.num_questions} questions x {args.question_tokens} tokens on a "
        f"{args.doc_tokens}-token document, {args.output_len} new tokens each",
        ["engine", "sequential s", "concurrent s", "s / question (seq)"],
        rows,
    )
    print_table(
        "time to first token",
        ["case", "seconds"],
        [
            ["cold document", cold_ttft],
            ["cached document", warm_ttft],
            ["question alone", question_only],
        ],
    )
    print(
        f"\ncaching speed-up: {seq_plain / seq_cached:.1f}x sequential, "
        f"{conc_plain / conc_cached:.1f}x concurrent; cached TTFT / question-only TTFT "
        f"{warm_ttft / question_only:.2f}; block hashing of a 128k-token prompt "
        f"{hashing['first']:.3f} ms per 1k tokens, {hashing['again']:.3f} again"
    )
    print(
        f"one cached question, {args.output_len} new tokens: {split.token_times_s[-1]:.3f} s "
        f"(first token {split.ttft_s:.3f} s, then {decode_ms:.1f} ms per token)"
    )
    write_json(args.out, results)
    return 0
