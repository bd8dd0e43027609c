"""Map-reduce summarization of long documents, every document's requests batched together.

Map: each chunk of a document (see :mod:`pipelines.chunking`) is summarized in at most
``max_summary_tokens`` tokens. Reduce: the partial summaries, in document order, are packed
greedily into groups that fit the chunk budget and each group is summarized again; a group
of one passes through unchanged. Levels repeat until one summary is left. ``reduce_depth``
counts the reduce levels (0: the document fit in one chunk and took one call).

Progress is guaranteed: the chunk budget holds at least two partial summaries (checked
when the options are resolved), so every level has fewer summaries than the one before.

:class:`Summarizer` and :class:`DocumentJob` only plan; they never touch an engine, so the
same plan runs concurrently on ``ragserve`` (:func:`summarize`) or one call at a time on
another backend (the benchmark's baseline).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.chunking import (
    Chunk,
    TokenizedText,
    chunk_text,
    default_overlap,
    tokenize_with_offsets,
    validate_chunking,
)
from pipelines.documents import Document, ErrorHandler, load_documents, log_error
from pipelines.plain_text import plain_text_tokenizer
from pipelines.progress import BatchProgress, RequestPump
from ragserve.sampling_params import SamplingParams

TEXT_SLOT = "{text}"
DEFAULT_MAP_TEMPLATE = "Summarize the following text in a few sentences.\n\n{text}"
DEFAULT_REDUCE_TEMPLATE = (
    "The following are summaries of consecutive parts of one document. "
    "Combine them into one summary of the whole document, in a few sentences.\n\n{text}"
)
SUMMARY_SEPARATOR = "\n\n"
_MARKER = "\x1fRAGSERVE-SLOT-{}\x1f"


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` exactly as written (special-token strings are recognised)."""
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


def chat_frame(tokenizer: Any, content: str, slots: Sequence[str]) -> list[str]:
    """The chat-templated prompt for one user turn, cut at ``slots`` (in order) into pieces.

    ``content`` holds every slot once. Without a chat template the content is used as is.
    Returns ``len(slots) + 1`` literal strings; the prompt is ``piece0 slot0 piece1 ...``.
    """
    marked = content
    for number, slot in enumerate(slots):
        if marked.count(slot) != 1:
            raise ValueError(f"the prompt template must contain {slot} exactly once")
        marked = marked.replace(slot, _MARKER.format(number))
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": marked}], add_generation_prompt=True, tokenize=False
        )
    else:
        rendered = marked
    pieces = []
    for number in range(len(slots)):
        before, found, rendered = rendered.partition(_MARKER.format(number))
        if not found:
            raise ValueError("the chat template dropped part of the prompt template")
        pieces.append(before)
    pieces.append(rendered)
    return pieces


def derive_seed(base: int, *parts: object) -> int:
    """A per-request seed that depends only on what the request is, not on when it runs."""
    digest = hashlib.blake2b(repr((base, *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF


@dataclass(frozen=True)
class SummarizeOptions:
    max_summary_tokens: int = 128
    chunk_tokens: int | None = None  # None: as much as the model's context allows
    overlap_tokens: int | None = None  # None: a tenth of the chunk, at most 128
    map_template: str = DEFAULT_MAP_TEMPLATE
    reduce_template: str = DEFAULT_REDUCE_TEMPLATE
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass
class Call:
    """One summarization request: which document, level and position it belongs to."""

    job: DocumentJob
    level: int
    index: int
    prompt: list[int]
    params: SamplingParams


@dataclass
class DocumentJob:
    """The map-reduce plan of one document; fed call results, it hands out the next calls."""

    summarizer: Summarizer
    document: Document
    tokenized: TokenizedText
    chunks: list[Chunk]
    priority: int = 0  # lower enters the engine first
    level: int = 0
    started: float = field(default_factory=time.perf_counter)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    num_calls: int = 0
    summary: str | None = None
    finish_reason: str | None = None
    failed: str | None = None
    _outputs: list[list[int] | None] = field(default_factory=list)
    _texts: list[str] = field(default_factory=list)
    _waiting: int = 0

    def first_calls(self) -> list[Call]:
        """The map calls: one per chunk."""
        ids = self.tokenized.token_ids
        inputs = [ids[c.token_start : c.token_end] for c in self.chunks]
        return self._level_calls([(list(x), None) for x in inputs], self.summarizer.map_frame)

    def complete(
        self, call: Call, text: str, generated_tokens: int, finish_reason: str | None
    ) -> list[Call]:
        """Record one call's summary; return the next level's calls once this level is done."""
        assert call.job is self and call.level == self.level and self._outputs[call.index] is None
        text = text.strip()
        self.generated_tokens += generated_tokens
        self.finish_reason = finish_reason
        self._texts[call.index] = text
        self._outputs[call.index] = encode(self.summarizer.text_tokenizer, text)
        self._waiting -= 1
        if self._waiting:
            return []
        if len(self._texts) == 1:
            self.summary = self._texts[0]
            return []
        return self._next_level()

    def fail(self, reason: str) -> None:
        self.failed = reason

    def owns(self, call: Call) -> bool:
        return call.job is self

    def _next_level(self) -> list[Call]:
        summarizer = self.summarizer
        outputs = [o for o in self._outputs if o is not None]
        assert len(outputs) == len(self._texts) >= 2
        groups = pack_summaries(
            outputs,
            summarizer.chunk_tokens,
            len(summarizer.separator_ids),
            summarizer.max_summary_tokens,
        )
        assert len(groups) < len(outputs), "a reduce level must shrink"
        texts = self._texts
        self.level += 1
        items: list[tuple[list[int], str | None]] = []
        for group in groups:
            if len(group) == 1:  # nothing to combine: carried to the next level unchanged
                items.append((outputs[group[0]], texts[group[0]]))
                continue
            joined: list[int] = []
            for position, member in enumerate(group):
                if position:
                    joined += summarizer.separator_ids
                joined += outputs[member][: summarizer.max_summary_tokens]
            items.append((joined, None))
        return self._level_calls(items, summarizer.reduce_frame)

    def _level_calls(
        self, items: list[tuple[list[int], str | None]], frame: tuple[list[int], list[int]]
    ) -> list[Call]:
        """Calls for the items without a ready summary; carried items are filled in at once."""
        head, tail = frame
        self._outputs = [ids if ready is not None else None for ids, ready in items]
        self._texts = [ready or "" for _, ready in items]
        calls = []
        for index, (ids, ready) in enumerate(items):
            if ready is not None:
                continue
            prompt = head + ids + tail
            self.prompt_tokens += len(prompt)
            params = self.summarizer.params_for(self.document.id, self.level, index)
            calls.append(Call(self, self.level, index, prompt, params))
        self._waiting = len(calls)
        self.num_calls += len(calls)
        assert calls, "every level has at least one call"
        return calls

    def result(self) -> dict[str, Any]:
        assert self.summary is not None
        return {
            "id": self.document.id,
            "source": self.document.source,
            "summary": self.summary,
            "document_tokens": len(self.tokenized),
            "summary_tokens": len(encode(self.summarizer.text_tokenizer, self.summary)),
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "num_chunks": len(self.chunks),
            "num_calls": self.num_calls,
            "reduce_depth": self.level,
            "finish_reason": self.finish_reason,
            "seconds": round(time.perf_counter() - self.started, 3),
        }


def pack_summaries(
    summaries: Sequence[Sequence[int]], capacity: int, separator_tokens: int, max_tokens: int
) -> list[list[int]]:
    """Consecutive groups (as index lists) whose joined tokens fit ``capacity``, packed greedily.

    Each summary counts as at most ``max_tokens`` tokens (longer ones are cut when joined).
    """
    groups: list[list[int]] = []
    used = 0
    for index, summary in enumerate(summaries):
        size = min(len(summary), max_tokens)
        if groups and used + separator_tokens + size <= capacity:
            groups[-1].append(index)
            used += separator_tokens + size
        else:
            groups.append([index])
            used = size
    return groups


class Summarizer:
    """Resolved options and tokenized prompt frames; starts one :class:`DocumentJob` per document."""

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        options: SummarizeOptions,
        text_tokenizer: Any | None = None,
    ) -> None:
        """``text_tokenizer`` encodes document and summary text (special-token strings as
        plain text); made from ``tokenizer`` when not given. The prompt frames use
        ``tokenizer``, whose chat template writes real control tokens."""
        if tokenizer is None:
            raise ValueError("summarization needs a model with a tokenizer")
        if options.max_summary_tokens < 1:
            raise ValueError(f"max_summary_tokens must be >= 1, got {options.max_summary_tokens}")
        self.tokenizer = tokenizer
        self.text_tokenizer = (
            text_tokenizer if text_tokenizer is not None else plain_text_tokenizer(tokenizer)
        )
        self.options = options
        self.max_summary_tokens = options.max_summary_tokens
        self.map_frame = self._frame(options.map_template)
        self.reduce_frame = self._frame(options.reduce_template)
        self.separator_ids = encode(tokenizer, SUMMARY_SEPARATOR)
        overhead = max(len(h) + len(t) for h, t in (self.map_frame, self.reduce_frame))
        # NOTE: the engine needs prompt + new tokens <= max_model_len.
        room = max_model_len - overhead - options.max_summary_tokens
        self.chunk_tokens = options.chunk_tokens if options.chunk_tokens is not None else room
        if self.chunk_tokens > room:
            raise ValueError(
                f"chunk_tokens {self.chunk_tokens} + prompt template {overhead} + "
                f"max_summary_tokens {options.max_summary_tokens} exceed the model's "
                f"context of {max_model_len} tokens (at most {room} chunk tokens fit)"
            )
        smallest = 2 * options.max_summary_tokens + len(self.separator_ids)
        if self.chunk_tokens < smallest:
            raise ValueError(
                f"chunk_tokens must hold two partial summaries to reduce them: at least "
                f"{smallest} for max_summary_tokens {options.max_summary_tokens}, got {self.chunk_tokens}"
            )
        self.overlap_tokens = (
            options.overlap_tokens
            if options.overlap_tokens is not None
            else default_overlap(self.chunk_tokens)
        )
        validate_chunking(self.chunk_tokens, self.overlap_tokens)
        SamplingParams(temperature=options.temperature, top_p=options.top_p)  # validate early

    def _frame(self, template: str) -> tuple[list[int], list[int]]:
        head, tail = chat_frame(self.tokenizer, template, [TEXT_SLOT])
        return encode(self.tokenizer, head), encode(self.tokenizer, tail)

    def start(self, document: Document, priority: int = 0) -> DocumentJob:
        tokenized = tokenize_with_offsets(self.text_tokenizer, document.text)
        chunks = chunk_text(tokenized, self.chunk_tokens, self.overlap_tokens)
        return DocumentJob(self, document, tokenized, chunks, priority)

    def params_for(self, document_id: str, level: int, index: int) -> SamplingParams:
        options = self.options
        seed = (
            None
            if options.temperature == 0
            else derive_seed(options.seed, document_id, level, index)
        )
        return SamplingParams(
            max_tokens=options.max_summary_tokens,
            temperature=options.temperature,
            top_p=options.top_p,
            seed=seed,
        )


def summarize(
    llm: Any,
    inputs: Iterable[str | Path | Document | Mapping[str, Any]],
    *,
    max_summary_tokens: int = 128,
    chunk_tokens: int | None = None,
    overlap_tokens: int | None = None,
    prompt_template: str | None = None,
    reduce_template: str | None = None,
    concurrency: int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    skip_ids: Collection[str] = (),
    use_tqdm: bool = True,
    on_error: ErrorHandler = log_error,
    namespace: str = "",
) -> Iterator[dict[str, Any]]:
    """Summarize documents (paths, folders, ``Document``s or ``{"text", "id"?}`` dicts).

    Yields one result dict per document as it finishes (see :meth:`DocumentJob.result`).
    A ``prompt_template`` (with ``{text}``) replaces both the map and the reduce prompt
    unless ``reduce_template`` is given too. Documents whose id is in ``skip_ids`` are
    skipped; bad inputs and failed requests go to ``on_error(source, reason)``.
    ``concurrency`` bounds the requests in the engine (default: its ``max_num_seqs``).
    """
    options = SummarizeOptions(
        max_summary_tokens=max_summary_tokens,
        chunk_tokens=chunk_tokens,
        overlap_tokens=overlap_tokens,
        map_template=prompt_template or DEFAULT_MAP_TEMPLATE,
        reduce_template=reduce_template or prompt_template or DEFAULT_REDUCE_TEMPLATE,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
    )
    engine = llm.engine
    summarizer = Summarizer(engine.tokenizer, engine.max_model_len, options)
    documents = [d for d in load_documents(inputs, on_error) if d.id not in skip_ids]
    return run_summaries(
        engine,
        summarizer,
        documents,
        concurrency or engine.info.max_num_seqs,
        use_tqdm=use_tqdm,
        on_error=on_error,
        namespace=namespace,
    )


def run_summaries(
    engine: Any,
    summarizer: Summarizer,
    documents: Sequence[Document],
    concurrency: int,
    *,
    use_tqdm: bool = True,
    on_error: ErrorHandler = log_error,
    namespace: str = "",
    on_progress: Callable[[RequestPump[Call]], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """Run the plans of ``documents`` through ``engine``, yielding results as documents finish.

    Documents start lazily, enough to keep about twice ``concurrency`` requests queued, and
    the calls of an earlier document enter the engine first, so results stream in roughly
    document order while the engine's batch stays full.
    """
    pending = list(reversed(documents))
    progress = BatchProgress(len(documents), "document", use_tqdm)
    try:
        with RequestPump[Call](engine, concurrency, namespace) as pump:
            while pending or pump.busy:
                while pending and pump.num_submitted - pump.num_finished < 2 * concurrency:
                    job = summarizer.start(pending.pop(), priority=len(documents) - len(pending))
                    for call in job.first_calls():
                        pump.submit(call, call.prompt, call.params, job.priority)
                completed = []
                for finished in pump.poll():
                    job = finished.tag.job
                    if job.failed:
                        continue
                    if finished.error is not None or finished.output is None:
                        job.fail(finished.error or "no output")
                        pump.drop(job.owns)  # its other calls are wasted work now
                        on_error(
                            job.document.source or job.document.id, f"request failed: {job.failed}"
                        )
                        progress.advance()
                        continue
                    completion = finished.output.outputs[0]
                    for call in job.complete(
                        finished.tag,
                        completion.text,
                        len(completion.token_ids),
                        completion.finish_reason,
                    ):
                        pump.submit(call, call.prompt, call.params, job.priority)
                    if job.summary is not None:
                        completed.append(job.result())
                # NOTE: follow-up calls are in the engine before the consumer gets control.
                for result in completed:
                    progress.advance()
                    yield result
                progress.show(pump)
                if on_progress is not None:
                    on_progress(pump)
    finally:
        progress.close()
