"""Runs the ``ragserve bench cpu`` workloads on vLLM's CPU build, as the comparison anchor.

A standalone script (it imports nothing from ragserve): ``ragserve bench cpu --vllm-python
PY`` runs ``PY vllm_cpu_driver.py SPEC.json OUT.json`` in vLLM's own virtual environment.
SPEC holds the model directory, the engine settings and the token-id prompts of every
workload; OUT receives the timings, written after each phase so a crash keeps the rest.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

STARTED = time.perf_counter()  # before vLLM is imported: start-up includes its imports


def _write(path: str, results: dict) -> None:
    with open(path + ".tmp", "w") as handle:
        json.dump(results, handle, indent=1)
    import os

    os.replace(path + ".tmp", path)


def main(spec_path: str, out_path: str) -> int:
    with open(spec_path) as handle:
        spec = json.load(handle)
    results: dict = {"phases": {}}
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    settings = spec["settings"]
    llm = LLM(
        model=spec["model_dir"],
        dtype=spec["dtype"],
        max_model_len=settings["max_model_len"],
        max_num_batched_tokens=settings["max_num_batched_tokens"],
        max_num_seqs=settings["max_num_seqs"],
        block_size=settings.get("block_size"),
        enable_prefix_caching=True,
        seed=0,
    )
    results["startup_s"] = time.perf_counter() - STARTED
    results["vllm_version"] = __import__("vllm").__version__
    _write(out_path, results)

    def greedy(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def run(prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        started = time.perf_counter()
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], greedy(max_tokens), use_tqdm=False
        )
        seconds = time.perf_counter() - started
        return seconds, [list(o.outputs[0].token_ids) for o in outputs]

    # A tiny request first, as ragserve's start-up also ends ready to serve.
    run([spec["warmup_prompt"]], 2)
    for phase in spec["phases"]:
        name = phase["name"]
        if phase["kind"] == "throughput":
            seconds, outputs = run(phase["prompts"], phase["output_len"])
            results["phases"][name] = {
                "seconds": seconds,
                "output_tokens": sum(len(o) for o in outputs),
            }
        elif phase["kind"] == "ttft":
            times = {}
            for prompt in phase["prompts"]:
                seconds, _ = run([prompt], 1)
                times[str(len(prompt))] = seconds
            results["phases"][name] = {"ttft_s": times}
        elif phase["kind"] == "questions":
            doc = phase["document"]
            each = []
            for question in phase["questions"]:
                seconds, _ = run([doc + question], phase["output_len"])
                each.append(seconds)
            results["phases"][name] = {
                "total_s": sum(each),
                "per_question_s": each,
                "first_s": each[0],
                "cached_median_s": statistics.median(each[1:]) if len(each) > 1 else None,
            }
        _write(out_path, results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
