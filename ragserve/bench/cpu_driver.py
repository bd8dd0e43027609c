"""Runs the ``ragserve bench cpu`` workloads on one engine, in a process of its own.

``ragserve bench cpu`` starts ``PYTHON cpu_driver.py ENGINE SPEC OUT`` once per engine run:
ragserve under ragserve's Python, vLLM's CPU build under the Python of vLLM's own virtual
environment (``--vllm-python``). Both go through the same phase code below with the same
token-id prompts, so the script imports nothing but the standard library at module level
(vLLM's environment has no ragserve). SPEC is the JSON the parent wrote; OUT receives the
results, rewritten after each phase so a crash keeps what was measured.

Every timing is wall time around the engine's offline ``generate`` call: greedy, EOS
ignored, prompts as token ids.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

Generate = Callable[[list[list[int]], int], list[list[int]]]


def _write(path: str, results: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as handle:
        json.dump(results, handle, indent=1)
    os.replace(path + ".tmp", path)


def ragserve_engine(spec: dict[str, Any], results: dict[str, Any]) -> Generate:
    from ragserve import LLM, SamplingParams
    from ragserve.bench.common import succeeded
    from ragserve.config import EngineConfig

    llm = LLM.from_config(EngineConfig(**spec["ragserve_config"]))
    info = llm.info
    results["kv_pool_bytes"] = info.num_kv_blocks * info.kv_bytes_per_block
    results["attention_backend"] = info.attention_backend
    results["dtype"] = str(info.dtype)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outputs = succeeded(llm.generate(prompts, params, use_tqdm=False))
        return [list(o.outputs[0].token_ids) for o in outputs]

    return generate


def vllm_engine(spec: dict[str, Any], results: dict[str, Any]) -> Generate:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    settings = spec["vllm_settings"]
    # NOTE: an explicit KV budget; without one vLLM's CPU worker reserves 92% of the node's
    # memory and refuses to start when other processes hold more than the rest.
    llm = LLM(
        model=spec["vllm_model_dir"],
        enable_prefix_caching=True,
        seed=0,
        kv_cache_memory_bytes=spec["vllm_kv_bytes"],
        **settings,
    )
    results["vllm_version"] = vllm.__version__
    results["kv_pool_bytes"] = spec["vllm_kv_bytes"]

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        outputs = llm.generate(inputs, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    return generate


def run_phases(
    generate: Generate, spec: dict[str, Any], results: dict[str, Any], out_path: str
) -> None:
    """The workloads of ``spec["phases"]`` in order; each result lands in ``results["phases"]``.

    A phase with several prompt sets (repeats) is timed once per set; its figures are the
    best of them, and every timing is kept beside them."""

    def timed(prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        started = time.perf_counter()
        outputs = generate(prompts, max_tokens)
        return time.perf_counter() - started, outputs

    phases: dict[str, Any] = results.setdefault("phases", {})
    for phase in spec["phases"]:
        kind = phase["kind"]
        if phase.get("warmup"):  # NOTE: untimed, at the shape the phase is timed at
            generate(phase["warmup"], phase.get("output_len", 1))
        if kind == "throughput":
            timings = [timed(prompts, phase["output_len"]) for prompts in phase["prompt_sets"]]
            phases[kind] = {
                "seconds": min(seconds for seconds, _ in timings),
                "all_seconds": [seconds for seconds, _ in timings],
                "output_tokens": sum(len(o) for o in timings[0][1]),
                "outputs": timings[0][1],  # the first set's: compared across engines
            }
        elif kind == "ttft":
            each = [
                {str(len(p)): timed([p], 1)[0] for p in prompts} for prompts in phase["prompt_sets"]
            ]
            phases[kind] = {length: min(t[length] for t in each) for length in each[0]}
            phases[kind]["all"] = each
        elif kind == "questions":
            sessions = []
            for doc in phase["documents"]:
                seconds = [
                    timed([doc["document"] + q], phase["output_len"])[0] for q in doc["questions"]
                ]
                sessions.append(seconds)
            phases[kind] = {
                "total_s": min(sum(s) for s in sessions),
                "cold_s": min(s[0] for s in sessions),
                "cached_median_s": (
                    min(statistics.median(s[1:]) for s in sessions)
                    if len(sessions[0]) > 1
                    else None
                ),
                "per_question_s": sessions,
            }
        else:
            raise ValueError(f"unknown phase {kind!r}")
        _write(out_path, results)


def main(engine: str, spec_path: str, out_path: str) -> int:
    with open(spec_path) as handle:
        spec = json.load(handle)
    results: dict[str, Any] = {"engine": engine}
    make = {"ragserve": ragserve_engine, "vllm": vllm_engine}[engine]
    generate = make(spec, results)
    results["ready_unix"] = time.time()  # the parent subtracts its spawn time: start-up
    started = time.perf_counter()
    generate([spec["warmup_prompt"]], 2)
    results["first_request_s"] = time.perf_counter() - started
    _write(out_path, results)
    run_phases(generate, spec, results, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3]))
