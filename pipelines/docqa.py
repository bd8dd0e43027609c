"""Batch question answering over documents, each document computed once per run.

Every prompt is ``prefix(document) + suffix(question)`` as token ids: the prefix (the chat
template's head, then the document) is tokenized once per document and the suffix (the
question and the template's tail) separately, so all questions about a document start
with the identical token ids and the engine's prefix cache serves the document to all of
them. A document's questions enter the engine together, and once its first answer is in
the document's cached blocks are pinned until its last question is answered, so memory
pressure from other documents cannot evict it half way.
"""

from __future__ import annotations

import codecs
import json
import os
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelines.documents import (
    Document,
    DocumentIndex,
    ErrorHandler,
    is_utf8,
    load_documents,
    log_error,
)
from pipelines.plain_text import plain_text_tokenizer
from pipelines.progress import BatchProgress, RequestPump
from pipelines.summarize import chat_frame, derive_seed, encode
from ragserve.document_reuse import DocumentReuse
from ragserve.sampling_params import SamplingParams

DOCUMENT_SLOT = "{document}"
QUESTION_SLOT = "{question}"
DEFAULT_QA_TEMPLATE = "Document:\n{document}\n\nQuestion: {question}"


@dataclass(frozen=True)
class Question:
    id: str
    doc: str  # a document id, file name or source path (the first, with several)
    question: str
    source: str = ""
    # Several documents, in the order the prompt puts them (empty: ``doc`` alone).
    docs: tuple[str, ...] = ()

    @property
    def documents(self) -> tuple[str, ...]:
        return self.docs or (self.doc,)


def load_questions(
    path: str | os.PathLike[str], on_error: ErrorHandler = log_error
) -> list[Question]:
    """Questions from a JSONL file of ``{"doc", "question", "id"?}``; bad lines are reported."""
    records: list[tuple[str, int, Any]] = []
    with open(path, "rb") as file:
        for number, raw in enumerate(file, start=1):
            source = f"{path}:{number}"
            if number == 1:  # NOTE: as documents are read: an editor's byte-order mark is no JSON
                raw = raw.removeprefix(codecs.BOM_UTF8)
            try:
                line = raw.decode()
            except UnicodeDecodeError as exc:
                on_error(source, f"not UTF-8 text (invalid byte at offset {exc.start})")
                continue
            if not line.strip():
                continue
            try:
                records.append((source, number, json.loads(line)))
            except json.JSONDecodeError as exc:
                on_error(source, f"invalid JSON: {exc.msg} at column {exc.colno}")
    return parse_questions(records, on_error)


def parse_questions(
    records: Iterable[tuple[str, int, Any]], on_error: ErrorHandler = log_error
) -> list[Question]:
    """Questions from ``(source, position, record)``; a missing id becomes ``<doc>#<position>``.

    The position is the line number for a file, so ids stay put when other lines are fixed.
    """
    questions: list[Question] = []
    seen: set[str] = set()
    for source, position, record in records:
        if isinstance(record, Question):
            question = record
        else:
            if not isinstance(record, Mapping):
                on_error(source, f"a question must be a JSON object, got {type(record).__name__}")
                continue
            doc, text = record.get("doc"), record.get("question")
            many = record.get("docs")
            docs: tuple[str, ...] = ()
            if many is not None:
                if not isinstance(many, list) or not many or not all(map(_is_name, many)):
                    on_error(source, "'docs' must be a non-empty list of document names")
                    continue
                docs = tuple(str(name) for name in many)
                doc = docs[0] if doc is None else doc
            if not _is_name(doc):
                on_error(source, "needs a field 'doc' naming a document (id or file name)")
                continue
            if not isinstance(text, str) or not text.strip():
                on_error(source, "needs a non-empty string field 'question'")
                continue
            if not is_utf8(text):
                on_error(source, "'question' holds a lone UTF-16 surrogate")
                continue
            raw_id = record.get("id")
            if raw_id is None:
                raw_id = f"{'+'.join(docs) or doc}#{position}"
            elif not _is_name(raw_id):
                on_error(source, f"'id' must be a non-empty string or an integer, got {raw_id!r}")
                continue
            question = Question(str(raw_id), str(doc), text, source, docs)
        if question.id in seen:
            on_error(source, f"duplicate question id {question.id!r}")
            continue
        seen.add(question.id)
        questions.append(question)
    return questions


def _is_name(doc: Any) -> bool:
    return (
        isinstance(doc, (str, int))
        and not isinstance(doc, bool)
        and str(doc) != ""
        and is_utf8(str(doc))
    )


class QAPrompts:
    """Token ids of the shared document prefix and of each question's private suffix.

    Documents and questions are user text: one that holds a special-token string is
    encoded apart from the template's frame, with such strings as plain text
    (:mod:`pipelines.plain_text`); other text is encoded with its frame as written, so
    its tokens are what the template alone would give.
    """

    def __init__(self, tokenizer: Any, template: str = DEFAULT_QA_TEMPLATE) -> None:
        if tokenizer is None:
            raise ValueError("document QA needs a model with a tokenizer")
        if template.find(DOCUMENT_SLOT) > template.find(QUESTION_SLOT):
            raise ValueError("the QA template must put {document} before {question}")
        self.tokenizer = tokenizer
        self.plain = plain_text_tokenizer(tokenizer)
        self.head, self.middle, self.tail = chat_frame(
            tokenizer, template, [DOCUMENT_SLOT, QUESTION_SLOT]
        )
        decoder = getattr(tokenizer, "added_tokens_decoder", {})
        self._controls = [t.content for t in decoder.values() if t.special]

    def _user_text(self, before: str, text: str, after: str) -> list[int]:
        if not any(control in text for control in self._controls):
            return encode(self.tokenizer, before + text + after)
        return (
            encode(self.tokenizer, before)
            + encode(self.plain, text)
            + encode(self.tokenizer, after)
        )

    def document_prefix(self, text: str) -> list[int]:
        return self._user_text(self.head, text, "")

    def question_suffix(self, question: str) -> list[int]:
        return self._user_text(self.middle, question, self.tail)

    def prompt(self, document_text: str, question: str) -> list[int]:
        return self.document_prefix(document_text) + self.question_suffix(question)

    def documents_prompt(
        self, texts: list[str], question: str
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Several documents in the document slot, each tokenized on its own (so each is
        the same token ids wherever it stands), separated by a blank line; returns the
        prompt and the documents' spans in it."""
        ids = encode(self.tokenizer, self.head)
        spans = []
        for text in texts:
            doc = self._user_text("", text, "\n\n")
            spans.append((len(ids), len(ids) + len(doc)))
            ids += doc
        return ids + self.question_suffix(question), spans


@dataclass
class _Asked:
    question: Question
    document: Document
    prefix_tokens: int
    submitted: float
    documents: list[Document] = field(default_factory=list)  # several: all, in order


def docqa(
    llm: Any,
    docs: Iterable[str | Path | Document | Mapping[str, Any]],
    questions: str | os.PathLike[str] | Iterable[Question | Mapping[str, Any]],
    *,
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    prompt_template: str = DEFAULT_QA_TEMPLATE,
    concurrency: int | None = None,
    skip_ids: Collection[str] = (),
    use_tqdm: bool = True,
    on_error: ErrorHandler = log_error,
    namespace: str = "",
    kv_reuse: str | None = None,
    recompute_ratio: float | None = None,
) -> Iterator[dict[str, Any]]:
    """Answer ``questions`` about ``docs``; yields one result dict per answer as it finishes.

    A question naming several documents (``"docs": [...]``) gets them in the order given;
    ``kv_reuse`` "blend" reuses the KV of those not leading the prompt from their segments,
    recomputing ``recompute_ratio`` of each (None: the engine's defaults).

    ``docs``: paths, folders, ``Document``s or ``{"text", "id"?}`` dicts. ``questions``:
    a JSONL file, ``Question``s or ``{"doc", "question", "id"?}`` dicts, where ``doc`` is a document id,
    file name or source path. Questions whose id is in ``skip_ids`` are skipped; unknown
    documents, bad questions and failed requests go to ``on_error(source, reason)``.
    """
    engine = llm.engine
    prompts = QAPrompts(engine.tokenizer, prompt_template)
    SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p)  # validate early
    index = DocumentIndex(load_documents(docs, on_error))
    if isinstance(questions, (str, os.PathLike)):
        parsed = load_questions(questions, on_error)
    else:
        parsed = parse_questions(
            (
                (q.source if isinstance(q, Question) else f"<question {n}>", n, q)
                for n, q in enumerate(questions, 1)
            ),
            on_error,
        )
    by_document: dict[str, list[Question]] = {}
    multi: list[tuple[list[Document], Question]] = []
    for question in parsed:
        if question.id in skip_ids:
            continue
        try:
            documents = [index.find(name) for name in question.documents]
        except KeyError as exc:
            on_error(question.source or question.id, str(exc.args[0]))
            continue
        if len(documents) > 1:
            multi.append((documents, question))
        else:
            by_document.setdefault(documents[0].id, []).append(question)
    work = [(index.by_id[doc_id], qs) for doc_id, qs in by_document.items()]

    def params_for(question: Question) -> SamplingParams:
        sample_seed = None if temperature == 0 else derive_seed(seed, question.id)
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=sample_seed
        )

    return _run(
        engine,
        prompts,
        work,
        params_for,
        concurrency or engine.info.max_num_seqs,
        use_tqdm,
        on_error,
        namespace,
        _MultiDocuments(multi, kv_reuse, recompute_ratio),
    )


@dataclass
class _MultiDocuments:
    """Questions over several documents each, and how their documents' KV is reused."""

    questions: list[tuple[list[Document], Question]]
    kv_reuse: str | None = None
    recompute_ratio: float | None = None

    def submit_all(
        self,
        pump: RequestPump[_Asked],
        prompts: QAPrompts,
        params_for: Callable[[Question], SamplingParams],
    ) -> None:
        now = time.perf_counter()
        for documents, question in self.questions:
            texts = [document.text for document in documents]
            prompt, spans = prompts.documents_prompt(texts, question.question)
            reuse = DocumentReuse(tuple(spans), self.kv_reuse, self.recompute_ratio)
            asked = _Asked(question, documents[0], spans[0][0], now, documents)
            pump.submit(asked, prompt, params_for(question), priority=1 << 30, reuse=reuse)
        self.questions = []


def _run(
    engine: Any,
    prompts: QAPrompts,
    work: list[tuple[Document, list[Question]]],
    params_for: Callable[[Question], SamplingParams],
    concurrency: int,
    use_tqdm: bool,
    on_error: ErrorHandler,
    namespace: str,
    multi: _MultiDocuments,
) -> Iterator[dict[str, Any]]:
    pending = list(reversed(work))
    outstanding: dict[str, int] = {}  # document id -> questions not answered yet
    prefixes: dict[str, list[int]] = {}
    pins: set[str] = set()
    pin_base = f"docqa-{id(prompts):x}"
    total = sum(len(qs) for _, qs in work) + len(multi.questions)
    progress = BatchProgress(total, "question", use_tqdm)
    try:
        with RequestPump[_Asked](engine, concurrency, namespace) as pump:
            while pending or pump.busy or multi.questions:
                if not pending and multi.questions:
                    # NOTE: once every single-document question is in: theirs share (and
                    # pin) each document's prefix first.
                    multi.submit_all(pump, prompts, params_for)
                while pending and pump.num_submitted - pump.num_finished < 2 * concurrency:
                    document, questions = pending.pop()
                    prefix = prefixes[document.id] = prompts.document_prefix(document.text)
                    outstanding[document.id] = len(questions)
                    now = time.perf_counter()
                    for question in questions:
                        prompt = prefix + prompts.question_suffix(question.question)
                        asked = _Asked(question, document, len(prefix), now)
                        pump.submit(
                            asked, prompt, params_for(question), priority=len(work) - len(pending)
                        )
                answered = []
                for finished in pump.poll():
                    asked = finished.tag
                    if asked.documents and finished.error is None and finished.output is not None:
                        answered.append(_result(asked, finished.output))
                        continue
                    if asked.documents:
                        progress.advance()
                        on_error(
                            asked.question.source or asked.question.id,
                            f"request failed: {finished.error}",
                        )
                        continue
                    doc_id = asked.document.id
                    outstanding[doc_id] -= 1
                    if outstanding[doc_id] and doc_id not in pins and finished.error is None:
                        engine.pin_prefix(f"{pin_base}-{doc_id}", prefixes[doc_id], namespace)
                        pins.add(doc_id)
                    if not outstanding[doc_id]:
                        del outstanding[doc_id], prefixes[doc_id]
                        if doc_id in pins:
                            engine.unpin_prefix(f"{pin_base}-{doc_id}")
                            pins.discard(doc_id)
                    if finished.error is not None or finished.output is None:
                        progress.advance()
                        on_error(
                            asked.question.source or asked.question.id,
                            f"request failed: {finished.error}",
                        )
                        continue
                    answered.append(_result(asked, finished.output))
                for result in answered:
                    progress.advance()
                    yield result
                progress.show(pump)
    finally:
        for doc_id in pins:
            engine.unpin_prefix(f"{pin_base}-{doc_id}")
        progress.close()


def _result(asked: _Asked, output: Any) -> dict[str, Any]:
    completion = output.outputs[0]
    return {
        "id": asked.question.id,
        "doc": asked.document.id,
        "source": asked.document.source,
        **({"docs": [d.id for d in asked.documents]} if asked.documents else {}),
        "question": asked.question.question,
        "answer": completion.text.strip(),
        "prompt_tokens": len(output.prompt_token_ids),
        "prefix_tokens": asked.prefix_tokens,
        "cached_tokens": output.num_cached_tokens,
        "blended_tokens": output.num_blended_tokens,
        "answer_tokens": len(completion.token_ids),
        "finish_reason": completion.finish_reason,
        "seconds": round(time.perf_counter() - asked.submitted, 3),
    }
