"""A sequence: one sample of one request, with its tokens, KV allocation and progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvstore.kv_cache_manager import KVAllocation
from ragserve.engine.detokenizer import IncrementalDetokenizer
from ragserve.outputs import Logprob
from ragserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ragserve.engine.blend_plan import BlendPlan


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Tokens grow at the end; ``num_computed_tokens`` catches up with them step by step.

    There are no prefill or decode phases: a sequence with many uncomputed tokens gets
    a prefill chunk, one with a single uncomputed token gets a decode step.
    """

    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    kv: KVAllocation
    detokenizer: IncrementalDetokenizer | None
    generator: torch.Generator | None = None
    tenant: str = ""  # the namespace it was added under: the unit of fair scheduling
    arrival_time: float = 0.0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from cache; set when the prompt is done
    prompt_tokens_computed: int = 0  # prompt tokens this sequence ran through the model
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_preemptions: int = 0
    blend: BlendPlan | None = None  # where reused document KV goes (None: prefix caching)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer else ""
