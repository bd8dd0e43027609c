"""The OpenAI-compatible API of a real ``ragserve serve``, through the official client."""

from __future__ import annotations

import json
import time
from typing import Any

import openai
import pytest
import requests
from openai.types.chat import ChatCompletionMessageParam

from tests.server.server_fixtures import ServerProcess, assert_error, module_server

pytestmark = pytest.mark.e2e

server = module_server()

RAW_QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
QUESTION: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "What is the capital of France?"}
]
PROMPT = "The three primary colors are"
JAPANESE = "東京は日本の首都です。大阪は"  # answered in characters split over tokens
LONG_PROMPT = " ".join(f"Fact {i}: the sky over town {i} was clear." for i in range(12))


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_models(client: openai.OpenAI, model: str) -> None:
    assert [m.id for m in client.models.list().data] == [model] == ["SmolLM2-135M-Instruct"]
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI, model: str) -> None:
    full = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=8, temperature=0
    )
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = full.usage
    assert usage is not None and usage.prompt_tokens > 10 and 1 <= usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert (
        usage.prompt_tokens_details is not None
        and usage.prompt_tokens_details.cached_tokens is not None
    )

    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=QUESTION,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    reasons = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert reasons == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == usage.prompt_tokens


def test_completions_streaming_with_logprobs(client: openai.OpenAI, model: str) -> None:
    full = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2
    )
    choice = full.choices[0]
    assert (
        full.usage is not None
        and full.usage.completion_tokens == 6
        and choice.finish_reason == "length"
    )
    logprobs = choice.logprobs
    assert (
        logprobs is not None and logprobs.tokens is not None and logprobs.top_logprobs is not None
    )
    assert logprobs.token_logprobs is not None and len(logprobs.tokens) == 6
    for token, value, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert len(top) == 2 and value <= 0.0
        assert max(top.values()) == pytest.approx(value)  # greedy picks the most likely token
        assert top[token] == pytest.approx(value)
    assert "".join(logprobs.tokens) == choice.text

    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == choice.text


def test_chat_top_logprobs(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = out.choices[0]
    assert (
        out.usage is not None
        and choice.logprobs is not None
        and choice.logprobs.content is not None
    )
    content = choice.logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert bytes(entry.bytes or []) == entry.token.encode()


def test_completion_logprobs_of_tokens_that_split_characters(
    client: openai.OpenAI, model: str
) -> None:
    kwargs: dict[str, Any] = dict(model=model, prompt=JAPANESE, max_tokens=8, temperature=0)
    out = client.completions.create(**kwargs, logprobs=2)
    choice = out.choices[0]
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.text_offset
    assert logprobs.top_logprobs is not None
    assert any(token.startswith("bytes:\\x") for token in logprobs.tokens)
    for token, start, top in zip(
        logprobs.tokens, logprobs.text_offset, logprobs.top_logprobs, strict=True
    ):
        assert len(top) == 2  # raw-byte tokens no longer collide as one U+FFFD key
        if not token.startswith("bytes:"):
            assert choice.text[start : start + len(token)] == token
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert logprobs.text_offset[-1] <= len(
        choice.text
    )  # the last may start a character yet unfinished
    streamed = client.completions.create(**kwargs, logprobs=2, stream=True)
    offsets = [
        o
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for o in c.choices[0].logprobs.text_offset or []
    ]
    assert offsets == logprobs.text_offset


def test_stop_token_ids_end_the_answer_without_their_text(
    client: openai.OpenAI, model: str, smollm_tokenizer: Any
) -> None:
    kwargs: dict[str, Any] = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    base = client.completions.create(**kwargs).choices[0].text
    comma = smollm_tokenizer.convert_tokens_to_ids(",")
    assert "," in base  # the greedy answer lists colors
    out = client.completions.create(
        **kwargs, extra_body={"stop_token_ids": [comma], "repetition_penalty": 1.0}
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.text == base[: base.index(",")]


def test_max_completion_tokens_stop_and_user(client: openai.OpenAI, model: str) -> None:
    base = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=10, temperature=0, user="u1"
    )
    text = base.choices[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    cut = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=10, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]

    chat = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        max_completion_tokens=2,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 2
    assert chat.choices[0].finish_reason == "length"


def test_n_with_seed_is_reproducible(client: openai.OpenAI, model: str) -> None:
    def sample() -> list[str]:
        out = client.chat.completions.create(
            model=model, messages=QUESTION, max_tokens=6, temperature=1.0, n=3, seed=1234
        )
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert out.usage is not None and 3 <= out.usage.completion_tokens <= 18
        return [c.message.content or "" for c in out.choices]

    first = sample()
    assert sample() == first
    streamed = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=6, temperature=1.0, n=3, seed=1234, stream=True
    )
    texts = {0: "", 1: "", 2: ""}
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert [texts[i] for i in range(3)] == first
    for edge in (-1, -(2**63), 2**63 - 1):  # every 64-bit seed is taken
        out = client.chat.completions.create(
            model=model, messages=QUESTION, max_tokens=2, temperature=1.0, n=2, seed=edge
        )
        assert len(out.choices) == 2


def test_batch_prompts_match_single_requests(client: openai.OpenAI, model: str) -> None:
    prompts = [PROMPT, "Once upon a time"]
    batch = client.completions.create(model=model, prompt=prompts, max_tokens=5, temperature=0)
    by_index = {c.index: c.text for c in batch.choices}
    for index, prompt in enumerate(prompts):
        single = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0)
        assert by_index[index] == single.choices[0].text
    assert batch.usage is not None and batch.usage.completion_tokens == 10


def test_token_id_prompt_and_zero_logprobs(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(
        model=model, prompt=[504, 1341, 2951], max_tokens=3, temperature=0, logprobs=0
    )
    assert out.usage is not None and out.usage.prompt_tokens == 3
    logprobs = out.choices[0].logprobs
    assert (
        logprobs is not None
        and logprobs.token_logprobs is not None
        and logprobs.top_logprobs is not None
    )
    assert len(logprobs.token_logprobs) == out.usage.completion_tokens
    assert all(top == {} for top in logprobs.top_logprobs)


def test_repeated_prompt_reports_cached_tokens(client: openai.OpenAI, model: str) -> None:
    first = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    second = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    assert first.usage is not None and second.usage is not None
    prompt_tokens = second.usage.prompt_tokens
    assert prompt_tokens > 64
    cached = second.usage.prompt_tokens_details
    assert cached is not None and cached.cached_tokens is not None
    # Every full block but the one holding the last prompt token is reused.
    assert cached.cached_tokens >= (prompt_tokens - 1) // 16 * 16 - 16
    assert first.choices[0].text == second.choices[0].text


def test_request_id_is_echoed(server: ServerProcess) -> None:
    response = requests.post(
        f"{server.url}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 1},
        headers={"X-Request-Id": "my-trace-42"},
        timeout=60,
    )
    assert response.status_code == 200
    assert response.headers["X-Request-Id"] == "my-trace-42"
    assert response.json()["id"] == "cmpl-my-trace-42"
    generated = requests.get(f"{server.url}/health", timeout=10).headers["X-Request-Id"]
    assert len(generated) == 32
    for unsafe in ("has spaces / and slashes", "x" * 200):
        bad = requests.get(f"{server.url}/health", headers={"X-Request-Id": unsafe}, timeout=10)
        assert len(bad.headers["X-Request-Id"]) == 32


def test_health_and_metrics(server: ServerProcess) -> None:
    health = requests.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    response = requests.get(f"{server.url}/metrics", timeout=30)
    assert response.headers["Content-Type"].startswith("text/plain")
    metrics = server.metrics()
    assert (
        metrics['ragserve_http_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 3
    )
    assert metrics['ragserve_time_to_first_token_seconds_count{endpoint="/v1/completions"}'] >= 5
    assert metrics['ragserve_inter_token_latency_seconds_count{endpoint="/v1/completions"}'] >= 5
    assert metrics['ragserve_kv_blocks{state="used"}'] == 0
    assert metrics['ragserve_kv_blocks{state="total"}'] > 0
    assert 0.0 < metrics["ragserve_prefix_cache_hit_rate"] <= 1.0
    assert metrics["ragserve_prompt_tokens_computed_total"] > 0
    assert metrics["ragserve_num_requests_running"] == 0
    assert metrics["ragserve_engine_steps_total"] > 0
    assert metrics["ragserve_engine_steps_ahead_total"] == 0  # asynchronous scheduling: CUDA only


def test_openapi_describes_every_route(server: ServerProcess) -> None:
    spec = requests.get(f"{server.url}/openapi.json", timeout=10).json()
    operations = {(m.upper(), p) for p, item in spec["paths"].items() for m in item}
    assert operations == {
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("GET", "/openapi.json"),
        ("GET", "/v1/models"),
        ("GET", "/v1/models/{model}"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/documents"),
        ("GET", "/v1/documents"),
        ("GET", "/v1/documents/{id}"),
        ("PATCH", "/v1/documents/{id}"),
        ("DELETE", "/v1/documents/{id}"),
        ("POST", "/v1/pipelines/summarize"),
        ("GET", "/v1/pipelines/summarize"),
        ("GET", "/v1/pipelines/summarize/{id}"),
        ("DELETE", "/v1/pipelines/summarize/{id}"),
    }
    schemas = spec["components"]["schemas"]
    assert {"messages", "documents", "max_completion_tokens"} <= set(
        schemas["ChatCompletionRequest"]["properties"]
    )
    # Every described route exists: probing it never gives the "no such route" 404 or a 405.
    for method, path in operations:
        url = server.url + path.replace("{model}", "x").replace("{id}", "0" * 32)
        response = requests.request(
            method, url, data=b"{}", headers={"Content-Type": "application/json"}, timeout=30
        )
        assert response.status_code != 405, (method, path)
        if response.status_code == 404:
            assert "no such route" not in json.dumps(response.json()), (method, path)


def test_unknown_model_and_route(server: ServerProcess) -> None:
    response = requests.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "gpt-9", "messages": RAW_QUESTION},
        timeout=10,
    )
    error = assert_error(response, 404, "model_not_found")
    assert error["param"] == "model"
    assert_error(requests.get(f"{server.url}/v2/nothing", timeout=10), 404)


def _chunks(body: str) -> list[Any]:
    events = [line.removeprefix("data: ") for line in body.split("\n\n") if line.strip()]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_raw_sse_framing(server: ServerProcess) -> None:
    response = requests.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": RAW_QUESTION, "max_tokens": 3, "temperature": 0, "stream": True},
        timeout=60,
    )
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    assert response.text.endswith("data: [DONE]\n\n")
    chunks = _chunks(response.text)
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1


def test_inter_token_latency_counts_steps_once_some_choices_have_stopped(
    server: ServerProcess,
) -> None:
    """n = 4 with a stop string: the choices stop at different steps, and the last one's
    steps each count once, not n times (the latencies of one request add up to no more
    than it took)."""
    key = 'ragserve_inter_token_latency_seconds_sum{endpoint="/v1/completions"}'
    body = {
        "prompt": PROMPT,
        "max_tokens": 48,
        "n": 4,
        "temperature": 1.0,
        "stop": ["."],
        "stream": True,
    }
    for seed in range(8):
        before = server.metrics().get(key, 0.0)
        started = time.perf_counter()
        response = requests.post(
            f"{server.url}/v1/completions", json={**body, "seed": seed}, stream=True, timeout=120
        )
        assert response.status_code == 200, response.text
        texts = ["", "", "", ""]
        for line in response.iter_lines():
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["text"]
        elapsed = time.perf_counter() - started
        lengths = {len(text) for text in texts}
        if len(lengths) > 1 and max(lengths) > 8:
            break
    else:
        pytest.fail("no seed gave choices that stop at different steps")
    assert server.metrics()[key] - before <= elapsed
