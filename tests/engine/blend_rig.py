"""Prompts of template + documents + question over a tiny random model, and a driver that
runs engine requests with document spans to completion."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ragserve import LLM, SamplingParams
from ragserve.engine.llm_engine import LLMEngine
from ragserve.outputs import RequestOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


TEMPLATE = random_tokens(7, 1)
DOCS = {"a": random_tokens(21, 2), "b": random_tokens(30, 3), "c": random_tokens(18, 4)}
QUESTIONS = [random_tokens(5, 10 + i) for i in range(3)]


@dataclass
class Prompt:
    token_ids: list[int]
    documents: list[tuple[int, int]]


def prompt(order: str, question: int = 0) -> Prompt:
    tokens, spans = list(TEMPLATE), []
    for name in order:
        spans.append((len(tokens), len(tokens) + len(DOCS[name])))
        tokens += DOCS[name]
    return Prompt(tokens + QUESTIONS[question], spans)


class Driver:
    def __init__(self, llm: LLM) -> None:
        self.engine: LLMEngine = llm.engine
        self.count = 0

    def run(
        self,
        prompt: Prompt,
        params: SamplingParams = GREEDY,
        namespace: str = "",
        **reuse: Any,
    ) -> RequestOutput:
        """One request to completion (any internal segment requests it queues run too)."""
        self.count += 1
        request_id = f"r{self.count}"
        self.engine.add_request(
            request_id,
            prompt.token_ids,
            params,
            namespace=namespace,
            documents=prompt.documents,
            **reuse,
        )
        done: RequestOutput | None = None
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                assert output.error is None, output.error
                assert output.request_id == request_id  # internal requests stay unseen
                if output.finished:
                    done = output
        assert done is not None
        return done


def tokens_of(output: RequestOutput) -> list[int]:
    return output.outputs[0].token_ids
