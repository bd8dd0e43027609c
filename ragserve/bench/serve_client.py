"""The client side of ``ragserve bench serve``: the workload (a document, questions on it)
and streamed chats over HTTP, each timed and never raising for a failed request."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

# NOTE: measured with SmolLM2's tokenizer on ``document_text``; the size is approximate by
# design and the server reports the exact count on upload.
TOKENS_PER_LINE = 28
_PARTS = ("bearing", "seal", "impeller", "shaft", "gasket", "rotor", "coupling", "sensor")
_PERIODS = ("days", "weeks", "months")


# -- workload ------------------------------------------------------------------------------
def document_text(approx_tokens: int, seed: int = 0) -> str:
    """A maintenance manual of about ``approx_tokens`` tokens, the same for the same inputs."""
    rng = random.Random(seed)
    lines = ["Maintenance manual of the pumping station."]
    for number in range(1, max(1, round(approx_tokens / TOKENS_PER_LINE)) + 1):
        lines.append(
            f"{number}. The {rng.choice(_PARTS)} of unit U-{rng.randint(100, 999)} runs at "
            f"{rng.randint(2, 900)} rpm and is inspected every {rng.randint(2, 12)} "
            f"{rng.choice(_PERIODS)}."
        )
    return "\n".join(lines)


def question(index: int) -> str:
    """Question ``index``: distinct for every index, so no two requests share a tail."""
    item = index % 50 + 1
    return f"Question {index}: which unit is item {item}, and how often is it inspected?"


def chat_body(doc_id: str, text: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": text}],
        "documents": [doc_id],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


# -- HTTP ----------------------------------------------------------------------------------
@dataclass
class RequestResult:
    """One streamed chat. ``error`` is None for a complete stream with a usage chunk;
    ``status`` is the HTTP status (None: no response)."""

    latency_s: float
    status: int | None = None
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


def percentile(values: list[float], fraction: float) -> float:
    """Linear interpolation between the closest ranks (``fraction`` in [0, 1])."""
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def wait_healthy(session: aiohttp.ClientSession, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with session.get(f"{url}/health") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health did not answer 200 within {timeout:.0f} s")
        await asyncio.sleep(0.2)


async def upload_document(
    session: aiohttp.ClientSession, url: str, text: str, timeout: float
) -> dict[str, Any]:
    """Upload and wait until the document leaves ``ingesting``; returns its final state."""
    async with session.post(f"{url}/v1/documents", json={"text": text}) as response:
        state: dict[str, Any] = await response.json()
        if response.status not in (200, 202):
            raise RuntimeError(f"document upload failed with {response.status}: {state}")
    deadline = time.monotonic() + timeout
    while state["status"] == "ingesting":
        if time.monotonic() > deadline:
            raise RuntimeError(f"document {state['id']} still ingesting after {timeout:.0f} s")
        await asyncio.sleep(0.1)
        async with session.get(f"{url}/v1/documents/{state['id']}") as response:
            state = await response.json()
    if state["status"] != "ready":
        raise RuntimeError(f"document {state['id']} is {state['status']}: {state.get('error')}")
    return state


async def stream_chat(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> RequestResult:
    """Send one streamed chat; never raises for a failed request (it is counted instead).

    TTFT is the time to the first chunk holding a choice: the server sends it once the
    first token is sampled (its text may still be held back by the detokenizer).
    """
    started = time.perf_counter()
    result = RequestResult(0.0)
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            result.status = response.status
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
            else:
                await _read_stream(response, result, started)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    result.latency_s = time.perf_counter() - started
    return result


async def _read_stream(
    response: aiohttp.ClientResponse, result: RequestResult, started: float
) -> None:
    done = False
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        if line == b"data: [DONE]":
            done = True
            break
        chunk = json.loads(line[len(b"data: ") :])
        if "error" in chunk:
            result.error = f"stream error: {chunk['error'].get('message', '')}"[:200]
            return
        if chunk.get("choices") and result.ttft_s is None:
            result.ttft_s = time.perf_counter() - started
        if chunk.get("usage"):
            usage = chunk["usage"]
            result.prompt_tokens = usage["prompt_tokens"]
            result.completion_tokens = usage["completion_tokens"]
            result.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
    if not done or not result.prompt_tokens:
        result.error = "the stream ended without [DONE] or without a usage chunk"
