"""The ``ragserve bench cpu`` workloads: their sizes and the token-id prompts every engine gets."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ragserve.bench.common import random_prompts

PHASES = ("throughput", "ttft", "questions")


@dataclasses.dataclass(frozen=True)
class Workload:
    """Sizes of the three phases; the defaults are issue #20's targets' workloads."""

    num_prompts: int = 32
    input_len: int = 256
    output_len: int = 64
    # 8191: SmolLM2 has 8,192 positions, one of them for the first answer token.
    ttft_lengths: tuple[int, ...] = (2048, 4096, 8191)
    doc_tokens: int = 4096
    num_questions: int = 8
    question_tokens: int = 20
    answer_tokens: int = 16
    # Each phase is timed this many times on fresh prompts, in the same process; the best
    # time is the figure. A shared host's load moves single timings by up to 2x.
    repeats: int = 3
    phases: tuple[str, ...] = PHASES

    @property
    def output_tokens(self) -> int:
        return self.num_prompts * self.output_len

    @property
    def max_len(self) -> int:
        """The longest sequence any phase makes (the engines' max_model_len)."""
        return max(
            self.input_len + self.output_len,
            *(n + 1 for n in self.ttft_lengths),
            self.doc_tokens + self.question_tokens + self.answer_tokens,
        )


# Small enough that ragserve's runs in both dtypes finish within a minute (vLLM's start-up
# alone is longer): a smoke test of the whole command.
QUICK = Workload(
    num_prompts=4,
    input_len=64,
    output_len=8,
    ttft_lengths=(256, 512),
    doc_tokens=512,
    num_questions=3,
    question_tokens=16,
    answer_tokens=4,
    repeats=1,
)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per size; unset ones come from the full workload, or ``--quick``'s."""
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    parser.add_argument("--phases", default=None, help=f"subset of {','.join(PHASES)}")
    for field in dataclasses.fields(Workload):
        if field.name == "phases":
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = str if field.name == "ttft_lengths" else int
        parser.add_argument(flag, type=kind, default=None, help=f"default {field.default}")


def workload_from_args(args: argparse.Namespace) -> Workload:
    base = QUICK if args.quick else Workload()
    changes: dict[str, Any] = {}
    for field in dataclasses.fields(Workload):
        value = getattr(args, field.name, None)
        if value is None:
            continue
        if field.name in ("ttft_lengths", "phases"):
            value = tuple(x.strip() for x in value.split(",") if x.strip())
            if field.name == "ttft_lengths":
                value = tuple(sorted({int(x) for x in value}))
        changes[field.name] = value
    workload = dataclasses.replace(base, **changes)
    unknown = set(workload.phases) - set(PHASES)
    if unknown:
        raise ValueError(f"unknown phases {sorted(unknown)}; choose from {', '.join(PHASES)}")
    return workload


def _seed(base: int, repeat: int) -> int:
    """Repeat 0 keeps the base seed (the same prompts as single runs); later repeats get ids
    that share no prefix with any other phase's (a prime stride)."""
    return base + 7919 * repeat


def phase_specs(workload: Workload, vocab_size: int) -> list[dict[str, Any]]:
    """Each phase's prompts, seeded: the same ids for every engine, dtype and round; one
    set per repeat, so no repeat is served from another's cache."""
    specs: list[dict[str, Any]] = []
    w = workload
    repeats = range(w.repeats)
    for name in w.phases:
        if name == "throughput":
            prompt_sets = [
                random_prompts(w.num_prompts, w.input_len, vocab_size, seed=_seed(1, i))
                for i in repeats
            ]
            # NOTE: the same shape in other ids: warms every engine without cache hits.
            warmup = random_prompts(w.num_prompts, w.input_len, vocab_size, seed=2)
            specs.append(
                {
                    "kind": name,
                    "prompt_sets": prompt_sets,
                    "warmup": warmup,
                    "output_len": w.output_len,
                }
            )
        elif name == "ttft":
            # A seed per length: no prompt shares a prefix with another (all cold).
            prompt_sets = [
                [
                    random_prompts(1, n, vocab_size, seed=_seed(100 + n, i))[0]
                    for n in w.ttft_lengths
                ]
                for i in repeats
            ]
            # NOTE: an untimed prompt of another id set pays the first-use costs (allocator
            # growth, thread pools, kernel builds) outside every timed prompt.
            warmup = random_prompts(1, min(w.ttft_lengths), vocab_size, seed=99)
            specs.append({"kind": name, "prompt_sets": prompt_sets, "warmup": warmup})
        else:
            documents = [
                {
                    "document": random_prompts(1, w.doc_tokens, vocab_size, seed=_seed(7, i))[0],
                    "questions": random_prompts(
                        w.num_questions, w.question_tokens, vocab_size, seed=_seed(8, i)
                    ),
                }
                for i in repeats
            ]
            specs.append({"kind": name, "documents": documents, "output_len": w.answer_tokens})
    return specs
