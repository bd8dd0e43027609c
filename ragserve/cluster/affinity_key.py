"""A request's routing key: what it reads, read from its path and JSON body without
tokenizing (the ingress holds no tokenizer).

- a completion or chat naming ``documents``: ``doc:<first id>`` (its KV leads the prompt);
- ``/v1/documents/<id>`` (GET, PATCH, DELETE): ``doc:<id>`` (an id of another form: none);
- any other completion or chat: ``text:`` + a hash of its leading ``LEAD_CHARS``
  characters (the prompt, or the messages' contents in order): prompts that share their
  first block share their first characters, so they meet on one replica;
- anything else (uploads, lists, models): no key.
"""

from __future__ import annotations

import json
from typing import Any

import xxhash

from ragserve.document_ids import is_document_id

# NOTE: about four 16-token blocks of English text: enough to tell documents apart,
# short enough that two questions on one pasted document share it.
LEAD_CHARS = 256
_GENERATION = ("/v1/completions", "/v1/chat/completions")


def document_key(doc_id: str) -> str | None:
    """None for a string of no document id's form: keys are kept by the router, so an
    unauthenticated client must not choose their size."""
    return f"doc:{doc_id}" if is_document_id(doc_id) else None


def routing_key(path: str, body: bytes) -> str | None:
    if path.startswith("/v1/documents/"):
        return document_key(path.removeprefix("/v1/documents/"))
    if path not in _GENERATION or not body:
        return None
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None  # NOTE: the replica answers the 400
    if not isinstance(parsed, dict):
        return None
    documents = parsed.get("documents")
    if isinstance(documents, list) and documents and isinstance(documents[0], str):
        return document_key(documents[0])
    lead = _leading_text(parsed)
    if not lead:
        return None
    return "text:" + xxhash.xxh3_64_hexdigest(lead[:LEAD_CHARS].encode("utf-8", "replace"))


def _leading_text(body: dict[str, Any]) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    messages = body.get("messages")
    parts: list[str] = []
    if isinstance(messages, list):
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
            if sum(map(len, parts)) >= LEAD_CHARS:
                break
    return "\n".join(parts)
