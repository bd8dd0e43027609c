"""Requests to token ids, with documents as an exact, shared token prefix.

A prompt that names documents is built as token lists joined end to end::

    head_ids + doc_ids(d1) + doc_ids(d2) + ... + tail_ids

``head_ids`` is fixed for the server's life: the chat template's opening of the system turn
followed by a short preamble. ``doc_ids(d)`` is computed once, at upload, from the
document text in a fixed wrapper. Because the pieces are tokenized separately and joined
as ids (never re-tokenized as one string), ``head_ids + doc_ids(d1)`` is bit-for-bit the
sequence prefilled at ingestion, so every question on ``d1`` hits its cached blocks.
For chat, ``tail_ids`` is the rest of the conversation as the chat template renders it
(the caller's own system message, if any, continues the system turn after the
documents). For completions, the prompt follows the documents directly, so one ingestion
serves both APIs.

Text from users (document text, completion prompts, chat content) never becomes control
tokens: it is encoded by a copy of the tokenizer set to treat special-token strings as
plain text (:mod:`pipelines.plain_text`), and chat messages go through
:mod:`ragserve.server.control_tokens`. Token ids given by the client are taken as they
are: that is how a client sends control tokens on purpose.

Tokenizer calls run off the event loop on :class:`TokenizerLanes` (large inputs on their
own thread). ``text_limit`` bounds the bytes of a prompt's text, checked before
tokenizing (:mod:`ragserve.server.text_limits`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from pipelines.plain_text import plain_text_tokenizer
from ragserve.server.control_tokens import ControlTokenGuard
from ragserve.server.errors import bad_request
from ragserve.server.text_limits import TextLimit
from ragserve.server.tokenizer_lanes import TokenizerLanes

T = TypeVar("T")

DOCUMENTS_PREAMBLE = "Use the following documents to answer.\n\n"
DOCUMENT_OPEN = "<document>\n"
DOCUMENT_CLOSE = "\n</document>\n\n"
# Marks where the system message's content goes when splitting a rendered chat template.
_SENTINEL = "\x00ragserve-documents\x00"


class PromptBuilder:
    """``text_limit`` comes from ``max_model_len`` and ``max_text_bytes`` (no limit
    without them)."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_model_len: int | None = None,
        max_text_bytes: int = sys.maxsize,
    ) -> None:
        if tokenizer is None:
            raise ValueError("the server needs a model with a tokenizer")
        self.tokenizer = tokenizer
        self.plain_tokenizer = plain_text_tokenizer(tokenizer)
        self._guard = ControlTokenGuard(tokenizer, self.plain_tokenizer)
        self._lanes = TokenizerLanes()
        self.text_limit = (
            TextLimit(max_text_bytes)
            if max_model_len is None
            else TextLimit.for_tokenizer(tokenizer, max_model_len, max_text_bytes)
        )
        self._chat_head = self._render_chat_head()
        self.head_ids = self._encode((self._chat_head or "") + DOCUMENTS_PREAMBLE)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a tokenizer call off the event loop; large inputs on their own thread."""
        return await self._lanes.run(fn, *args)

    def close(self) -> None:
        self._lanes.close()

    # -- called on a tokenizer thread --------------------------------------------------------
    def _encode(self, text: str, special_tokens_as_text: bool = False) -> list[int]:
        tokenizer = self.plain_tokenizer if special_tokens_as_text else self.tokenizer
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def _render_chat_head(self) -> str | None:
        """The template's text before the system content, or None if it has no system turn."""
        if not getattr(self.tokenizer, "chat_template", None):
            return None
        try:
            text = self._render(
                [{"role": "system", "content": _SENTINEL}, {"role": "user", "content": "?"}]
            )
        except Exception:
            return None
        head, found, _ = text.partition(_SENTINEL)
        return head if found else None

    def _render(self, messages: list[dict[str, str]]) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return str(text)

    def document_ids(self, text: str) -> list[int]:
        """A document's own tokens in its fixed wrapper; special-token strings stay plain text."""
        return self._encode(DOCUMENT_OPEN + text + DOCUMENT_CLOSE, special_tokens_as_text=True)

    def completion_ids(self, prompt: str | list[int], documents: Sequence[list[int]]) -> list[int]:
        """A text prompt is all user text: special-token strings in it stay plain text."""
        if not documents:
            if isinstance(prompt, list):
                return list(prompt)
            return list(self.plain_tokenizer.encode(prompt))  # BOS as the tokenizer adds it
        if isinstance(prompt, list):
            return self._join(documents, list(prompt))
        return self._join(documents, self._encode(prompt, special_tokens_as_text=True))

    def chat_ids(self, messages: list[dict[str, str]], documents: Sequence[list[int]]) -> list[int]:
        """The chat template's control tokens around the messages' content as plain text."""
        messages, marks = self._guard.mark(messages)
        if not documents:
            try:
                text = self._render(messages)
            except Exception as exc:
                raise bad_request(
                    f"the chat template rejected the messages: {exc}", "messages"
                ) from None
            return self._guard.encode(text, marks)
        if self._chat_head is None:
            raise bad_request(
                "this model's chat template has no system turn, so documents cannot be used "
                "with chat; use /v1/completions",
                "documents",
            )
        if any(_SENTINEL in m["content"] for m in messages):
            raise bad_request("message content contains a reserved marker", "messages")
        own_system = ""
        if messages[0]["role"] == "system":
            own_system, messages = messages[0]["content"], messages[1:]
        conversation = [{"role": "system", "content": _SENTINEL + own_system}, *messages]
        try:
            text = self._render(conversation)
        except Exception as exc:
            raise bad_request(
                f"the chat template rejected the messages: {exc}", "messages"
            ) from None
        parts = text.split(_SENTINEL)
        if len(parts) != 2:
            raise bad_request(
                "the chat template does not keep the system message as given", "messages"
            )
        return self._join(documents, self._guard.encode(parts[1], marks))

    def _join(self, documents: Sequence[list[int]], tail: list[int]) -> list[int]:
        ids = list(self.head_ids)
        for doc in documents:
            ids += doc
        return ids + tail

    def document_spans(self, documents: Sequence[list[int]]) -> list[tuple[int, int]]:
        """Where each document's tokens lie in a prompt built by ``_join``."""
        spans, start = [], len(self.head_ids)
        for doc in documents:
            spans.append((start, start + len(doc)))
            start += len(doc)
        return spans

    def document_prefix(self, doc_ids: list[int]) -> list[int]:
        """What ingestion prefills: exactly the start of any prompt naming this document first."""
        return self._join([doc_ids], [])
