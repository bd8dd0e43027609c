"""One request inside the engine: its sequences (``n`` of them) and how its output is built."""

from __future__ import annotations

from dataclasses import dataclass

from ragserve.engine.sequence import Sequence
from ragserve.outputs import CompletionOutput, RequestOutput
from ragserve.sampling_params import SamplingParams


@dataclass
class EngineRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float
    first_token_time: float | None = None
    internal: bool = False  # computes a segment for the engine itself: no caller sees it

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    def output(self, block_size: int) -> RequestOutput:
        """What the caller sees now: text, tokens, finish reasons and where the cache hit."""
        with_logprobs = self.params.logprobs is not None
        completions = [
            CompletionOutput(
                index=seq.index,
                text=seq.detokenizer.stream_text(seq.is_finished) if seq.detokenizer else "",
                token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=list(seq.logprobs) if with_logprobs else None,
                cumulative_logprob=seq.cumulative_logprob if with_logprobs else None,
            )
            for seq in self.seqs
        ]
        metrics = {"arrival_time": self.arrival_time}
        cached = max(0, min(seq.num_cached_tokens for seq in self.seqs))
        if self.first_token_time is not None:
            metrics["first_token_time"] = self.first_token_time
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=self.finished,
            num_cached_tokens=cached,
            cached_tokens_by_tier=split_by_tier(cached, self.seqs[0].kv.loaded_blocks, block_size),
            metrics=metrics,
            num_blended_tokens=min(
                seq.blend.blended_tokens if seq.blend else 0 for seq in self.seqs
            ),
            num_recomputed_tokens=min(
                seq.blend.recomputed_tokens if seq.blend else 0 for seq in self.seqs
            ),
        )

    def safe_output(self, block_size: int) -> RequestOutput:
        """The output, or a bare one when building it is what failed."""
        try:
            return self.output(block_size)
        except Exception:
            return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [])


def split_by_tier(cached: int, loaded_blocks: dict[str, int], block_size: int) -> dict[str, int]:
    """Split ``cached`` prompt tokens into those loaded from each tier and the rest, which
    were on the device already. NOTE: a preempted sequence may load a block twice; the
    split is capped so that it always sums to ``cached``."""
    split: dict[str, int] = {}
    left = cached
    for name, blocks in sorted(loaded_blocks.items()):
        split[name] = min(left, blocks * block_size)
        left -= split[name]
    return {"device": left, **split}
