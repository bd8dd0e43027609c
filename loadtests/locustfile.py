"""Locust users that behave like ``ragserve``'s real clients.

- :class:`DocQAUser`: questions about documents of a shared corpus (Zipf popularity).
  Uploads a document the first time this process needs it (the server deduplicates by
  content, so concurrent uploads of one text are one document), then streams answers from
  ``/v1/chat/completions`` with ``documents`` to the end.
- :class:`ChatUser`: short multi-turn chats; each turn resends the whole conversation, so
  every prefix but the newest turn is in the cache.
- :class:`SummarizeUser`: ``POST /v1/pipelines/summarize`` with ``{"text",
  "max_summary_tokens"}`` while the server has that route; a 404/405 there (the route is not
  served yet) switches this process to a streamed chat asking to summarize an uploaded
  corpus document. The probe's 404 is reported as ``summarize ... [absent]``, not a failure.
- :class:`IngestUser`: bursts of uploads of fresh documents, waits until each is ready
  (``READY`` row), then deletes them, so pinned KV blocks stay bounded in a long run.

Run it through ``python -m loadtests.runner`` (or ``ragserve loadtest``), which starts the
server and writes the report; directly: ``PYTHONPATH=. locust -f loadtests/locustfile.py
--host http://127.0.0.1:8000``. Non-loopback hosts are refused. Custom metrics and the
handling of 503s are described in :mod:`loadtests.metrics`.
"""

from __future__ import annotations

import itertools
import logging
import random
import sys
import time
from functools import cache
from pathlib import Path
from typing import Any

import gevent
import requests
from locust import HttpUser, between, events, task
from locust.env import Environment

from loadtests import require_loopback
from loadtests.corpus import (
    CHAT_TOPICS,
    FOLLOW_UPS,
    SUMMARY_REQUEST,
    Corpus,
    CorpusDocument,
    build_corpus,
    ingest_text,
)
from loadtests.metrics import (
    ABSENT_SUFFIX,
    READY,
    SUMMARIZE_PATH,
    StreamResult,
    fire,
    fire_timeout,
    iter_lines,
    json_object,
    meta,
    read_chat_stream,
    record_job,
    record_stream,
    retry_after,
    settle,
    write_client_summary,
)

logger = logging.getLogger(__name__)

CHAT = "/v1/chat/completions"
DOCUMENTS = "/v1/documents"
_PENDING = ("queued", "running", "in_progress", "pending")
_POLL_S = 0.5

_user_numbers = itertools.count()
_document_ids: dict[str, str] = {}  # corpus key -> server id, shared by this process's users
_pipeline: dict[str, bool] = {}  # "available" once probed


@events.init_command_line_parser.add_listener
def add_options(parser: Any, **_: Any) -> None:
    group = parser.add_argument_group("ragserve workload")
    group.add_argument("--max-tokens", type=int, default=16, help="tokens per answer")
    group.add_argument("--doc-tokens", type=int, default=300, help="approximate document size")
    group.add_argument("--num-docs", type=int, default=8, help="documents in the shared corpus")
    group.add_argument("--corpus-seed", type=int, default=0)
    group.add_argument("--zipf", type=float, default=1.1, help="popularity exponent")
    group.add_argument("--chat-turns", type=int, default=4, help="user turns per conversation")
    group.add_argument("--ingest-burst", type=int, default=3, help="uploads per burst")
    group.add_argument("--request-timeout", type=float, default=60.0, help="seconds")
    group.add_argument("--client-summary", default="", help="write exact aggregates here")


@events.init.add_listener
def check_target(environment: Environment, **_: Any) -> None:
    try:
        require_loopback(environment.host or "")
    except ValueError as exc:
        logger.error("%s", exc)
        # NOTE: SystemExit passes through locust's event dispatch; an exception would only
        # be logged and the test would run anyway.
        sys.exit(2)


@events.quitting.add_listener
def save_summary(environment: Environment, **_: Any) -> None:
    path = environment.parsed_options.client_summary if environment.parsed_options else ""
    if path:
        write_client_summary(environment, Path(path))


@cache
def shared_corpus(num_docs: int, doc_tokens: int, seed: int, zipf: float) -> Corpus:
    return build_corpus(num_docs, doc_tokens, seed, zipf)


class RagUser(HttpUser):
    """Common request helpers: every request is judged by :func:`loadtests.metrics.settle`."""

    abstract = True
    wait_time = between(0.2, 1.0)
    label = "base"

    def on_start(self) -> None:
        options = self.environment.parsed_options
        assert options is not None
        self.max_tokens: int = options.max_tokens
        self.timeout: float = options.request_timeout
        self.number = next(_user_numbers)
        self.last_status = 0  # of the last chat request
        self.rng = random.Random(f"{options.corpus_seed}:{self.label}:{self.number}")
        self.corpus = shared_corpus(
            options.num_docs, options.doc_tokens, options.corpus_seed, options.zipf
        )

    def stream_chat(
        self, messages: list[dict[str, str]], documents: list[str]
    ) -> StreamResult | None:
        """One streamed chat completion read to the end; None if rejected or failed."""
        body: dict[str, Any] = {
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if documents:
            body["documents"] = documents
        started = time.perf_counter()
        with self.client.post(
            CHAT,
            json=body,
            name=f"{self.label} {CHAT}",
            stream=True,
            catch_response=True,
            timeout=self.timeout,
        ) as response:
            self.last_status = response.status_code
            outcome = settle(response)
            if outcome != "ok":
                wait = retry_after(response) if outcome == "rejected" else 0.0
                result = None
            else:
                wait, result = 0.0, self._read_stream(response, started)
        gevent.sleep(wait)
        if result is not None:
            record_stream(self.label, result)
        return result

    def _read_stream(self, response: Any, started: float) -> StreamResult | None:
        try:
            result = read_chat_stream(iter_lines(response), started)
        except (requests.RequestException, ValueError) as exc:
            response.failure(f"[stream] {type(exc).__name__}")
            return None
        request_meta = meta(response)
        request_meta["response_time"] = (time.perf_counter() - started) * 1000
        request_meta["response_length"] = result.bytes_read
        problem = result.problem(want_usage=True)
        if problem is not None:
            response.failure(problem)
            return None
        response.success()
        return result

    def upload(self, text: str, metadata: dict[str, Any], label: str) -> str | None:
        """The document's id (new or already known to the server); None if rejected or failed."""
        doc_id: str | None = None
        wait = 0.0
        with self.client.post(
            DOCUMENTS,
            json={"text": text, "metadata": metadata},
            name=f"{label} {DOCUMENTS}",
            catch_response=True,
            timeout=self.timeout,
        ) as response:
            outcome = settle(response, expected=(200, 202))
            if outcome == "rejected":
                wait = retry_after(response)
            elif outcome == "ok" and (body := json_object(response)) is not None:
                if isinstance(body.get("id"), str):
                    doc_id = body["id"]
                    response.success()
                else:
                    response.failure("[protocol] upload answer without an id")
        gevent.sleep(wait)
        return doc_id

    def corpus_document_id(self, doc: CorpusDocument) -> str | None:
        """Upload the document unless this process already knows its id."""
        doc_id = _document_ids.get(doc.key)
        if doc_id is None:
            doc_id = self.upload(doc.text, {"key": doc.key}, self.label)
            if doc_id is not None:
                _document_ids[doc.key] = doc_id
        return doc_id


class DocQAUser(RagUser):
    weight = 6
    label = "docqa"

    @task
    def ask(self) -> None:
        doc = self.corpus.pick(self.rng)
        doc_id = self.corpus_document_id(doc)
        if doc_id is not None:
            question = self.rng.choice(doc.questions)
            self.stream_chat([{"role": "user", "content": question}], [doc_id])
            if self.last_status == 404:  # the document is gone: upload it again next time
                _document_ids.pop(doc.key, None)


class ChatUser(RagUser):
    weight = 3
    label = "chat"

    def on_start(self) -> None:
        super().on_start()
        self.messages: list[dict[str, str]] = []
        self.turns = self.environment.parsed_options.chat_turns

    @task
    def turn(self) -> None:
        user_turns = sum(1 for m in self.messages if m["role"] == "user")
        if user_turns >= self.turns:
            self.messages = []
        content = self.rng.choice(FOLLOW_UPS if self.messages else CHAT_TOPICS)
        self.messages.append({"role": "user", "content": content})
        result = self.stream_chat(self.messages, [])
        if result is None:
            self.messages.pop()  # NOTE: keep the turns alternating; the next task retries
        else:
            self.messages.append({"role": "assistant", "content": result.text})


class SummarizeUser(RagUser):
    weight = 1
    label = "summarize"
    wait_time = between(1.0, 3.0)

    @task
    def summarize(self) -> None:
        doc = self.corpus.pick(self.rng)
        if _pipeline.get("available", True) and self._pipeline_job(doc):
            return
        doc_id = self.corpus_document_id(doc)
        if doc_id is not None:
            self.stream_chat([{"role": "user", "content": SUMMARY_REQUEST}], [doc_id])

    def _pipeline_job(self, doc: CorpusDocument) -> bool:
        """Run one summarization job; False when the server has no such route."""
        body = {"text": doc.text, "max_summary_tokens": self.max_tokens}
        name = f"{self.label} {SUMMARIZE_PATH}"
        submitted = time.perf_counter()
        with self.client.post(
            SUMMARIZE_PATH, json=body, name=name, catch_response=True, timeout=self.timeout
        ) as response:
            if response.status_code in (404, 405):
                meta(response)["name"] += ABSENT_SUFFIX
                response.success()
                _pipeline["available"] = False
                logger.info("no %s on the server: summarizing through chat", SUMMARIZE_PATH)
                return False
            _pipeline["available"] = True
            outcome = settle(response, expected=(200, 201, 202))
            job: dict[str, Any] | None = None
            if outcome == "ok" and (job := json_object(response)) is not None:
                response.success()
        if outcome == "rejected":
            gevent.sleep(retry_after(response))
        elif job is not None and job.get("status") in _PENDING and "id" in job:
            job = self._poll_job(str(job["id"]))
        if job is not None and job.get("status") not in _PENDING:
            record_job(self.label, job, time.perf_counter() - submitted)
        return True

    def _poll_job(self, job_id: str) -> dict[str, Any] | None:
        """The job once it has ended; None after a failed poll or the time limit."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            gevent.sleep(_POLL_S)
            with self.client.get(
                f"{SUMMARIZE_PATH}/{job_id}",
                name=f"{self.label} {SUMMARIZE_PATH}/{{id}}",
                catch_response=True,
                timeout=self.timeout,
            ) as response:
                job = json_object(response) if settle(response) == "ok" else None
                if job is None:
                    return None
                response.success()
            if job.get("status") not in _PENDING:
                return job
        fire_timeout(f"{self.label} {SUMMARIZE_PATH}/{{id}}", self.timeout, "job not done")
        return None


class IngestUser(RagUser):
    weight = 1
    label = "ingest"
    wait_time = between(2.0, 5.0)

    def on_start(self) -> None:
        super().on_start()
        self.burst_size = self.environment.parsed_options.ingest_burst
        self.doc_tokens = self.environment.parsed_options.doc_tokens
        self.bursts = 0

    @task
    def burst(self) -> None:
        self.bursts += 1
        uploaded: list[tuple[str, float]] = []
        for index in range(self.burst_size):
            tag = f"{self.number}-{self.bursts}-{index}"
            started = time.perf_counter()
            doc_id = self.upload(ingest_text(tag, self.doc_tokens), {"burst": tag}, self.label)
            if doc_id is not None:
                uploaded.append((doc_id, started))
        for doc_id, started in uploaded:
            self._wait_ready(doc_id, started)
        for doc_id, _ in uploaded:
            self._delete(doc_id)

    def _wait_ready(self, doc_id: str, started: float) -> None:
        name = f"{self.label} {DOCUMENTS}/{{id}}"
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            with self.client.get(
                f"{DOCUMENTS}/{doc_id}", name=name, catch_response=True, timeout=self.timeout
            ) as response:
                state = json_object(response) if settle(response) == "ok" else None
                if state is None:
                    return
                if state.get("status") == "failed":
                    response.failure(f"[ingest] failed: {str(state.get('error'))[:80]}")
                    return
                response.success()
            if state.get("status") == "ready":
                fire(READY, self.label, (time.perf_counter() - started) * 1000)
                return
            gevent.sleep(_POLL_S)
        fire_timeout(name, self.timeout, "document not ready")

    def _delete(self, doc_id: str) -> None:
        with self.client.delete(
            f"{DOCUMENTS}/{doc_id}",
            name=f"{self.label} DELETE {DOCUMENTS}/{{id}}",
            catch_response=True,
            timeout=self.timeout,
        ) as response:
            if settle(response) == "ok":
                response.success()
