"""OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Defaults: chat generates up to the end of the context unless ``max_tokens`` /
``max_completion_tokens`` is given (as OpenAI does); completions default to
``ServerConfig.completion_default_max_tokens`` (16, OpenAI's default), clamped to the room
left in the context. ``documents`` (an extension) puts uploaded documents first.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from aiohttp import web

from ragserve.document_reuse import DocumentReuse
from ragserve.engine.async_engine import EngineRequestError
from ragserve.outputs import RequestOutput
from ragserve.sampling_params import MAX_N, SEED_RANGE, SamplingParams
from ragserve.server.admission_checks import check_admission, estimate_work
from ragserve.server.body import parse_request
from ragserve.server.cache_report import document_notes
from ragserve.server.errors import APIError, bad_request, error_body, from_engine_error
from ragserve.server.generation import (
    GenerationJob,
    SSEWriter,
    check_context,
    make_sampling_params,
    run_job,
)
from ragserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from ragserve.server.request_context import request_id, tenant
from ragserve.server.responses import (
    StreamState,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    usage,
)
from ragserve.server.state import (
    ADMISSION,
    CONFIG,
    DOCUMENTS,
    DRAINING,
    ENGINE,
    METRICS,
    MODEL_NAME,
    PROMPTS,
    REQUESTS_IN_FLIGHT,
    STARTED_AT,
)
from ragserve.server.tenant_limits import RequestsInFlight
from ragserve.server.token_text import TextOffsets, TokenText

logger = logging.getLogger(__name__)

MAX_BATCH_PROMPTS = 64
CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
Emit = Callable[[int, RequestOutput, StreamState], Awaitable[None]]


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)  # names may hold "/"
    app.router.add_post(COMPLETIONS_ENDPOINT, completions)
    app.router.add_post(CHAT_ENDPOINT, chat_completions)


def _model_card(app: web.Application) -> dict[str, Any]:
    return {
        "id": app[MODEL_NAME],
        "object": "model",
        "created": app[STARTED_AT],
        "owned_by": "ragserve",
        "max_model_len": app[ENGINE].max_model_len,
    }


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app)]})


async def get_model(request: web.Request) -> web.Response:
    _resolve_model(request.app, request.match_info["model"])
    return web.json_response(_model_card(request.app))


def _resolve_model(app: web.Application, requested: str | None) -> str:
    name = app[MODEL_NAME]
    if requested is not None and requested != name:
        raise APIError(
            404,
            f"the model {requested[:200]!r} does not exist; this server serves {name!r}",
            param="model",
            code="model_not_found",
        )
    return name


def _seed(seed: int | None) -> int | None:
    # NOTE: OpenAI takes any 64-bit seed; the engine takes non-negative ones with room for
    # n samples' seeds above them.
    return None if seed is None else seed % (SEED_RANGE[1] - MAX_N + 1)


def _sampling_params(
    body: GenerationRequest, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    return make_sampling_params(
        n=body.n,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=_seed(body.seed),
        max_tokens=max_tokens,
        min_tokens=body.min_tokens,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids,
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
    )


async def _prepare(
    request: web.Request, body: GenerationRequest, num_prompts: int = 1
) -> tuple[str, list[list[int]]]:
    """Common checks, all before any tokenizing (a tenant at its limit of requests in flight
    is refused cheaply); returns the model name and the documents' token lists."""
    app = request.app
    model = _resolve_model(app, body.model)
    config = app[CONFIG]
    app[REQUESTS_IN_FLIGHT].check(tenant(request), num_prompts)
    if body.n > config.max_n:
        raise bad_request(f"n must be at most {config.max_n}, got {body.n}", "n")
    doc_ids = body.documents or []
    if len(doc_ids) > config.max_documents_per_request:
        raise bad_request(
            f"at most {config.max_documents_per_request} documents per request, got {len(doc_ids)}",
            "documents",
        )
    await app[DOCUMENTS].learn(tenant(request), doc_ids)  # uploaded through another server
    return model, app[DOCUMENTS].token_lists(tenant(request), doc_ids)


def _reuse(
    request: web.Request, body: GenerationRequest, documents: list[list[int]]
) -> DocumentReuse | None:
    """Where the documents lie in the prompt (they lead it, after the fixed head) and how
    the request wants their KV reused."""
    if not documents:
        return None
    spans = tuple(request.app[PROMPTS].document_spans(documents))
    return DocumentReuse(spans, body.kv_reuse, body.blend_recompute_ratio)


def _job(
    request: web.Request,
    prefix: str,
    prompts: list[list[int]],
    params: SamplingParams,
    doc_ids: list[str] | None,
    reuse: DocumentReuse | None = None,
) -> GenerationJob:
    """Admit the request (503 past the server's limits, 429 past the tenant's) and count
    its work until it ends."""
    app = request.app
    engine, admission = app[ENGINE], app[ADMISSION]
    cached = app[DOCUMENTS].cached_prefix_tokens(tenant(request), doc_ids or [])
    prompt_work, answer_work = estimate_work(
        [len(ids) for ids in prompts], cached, params, engine.max_model_len
    )
    # NOTE: no await from here until the job is held in flight (``_collect``, ``_stream``).
    app[REQUESTS_IN_FLIGHT].check(tenant(request), len(prompts))
    check_admission(
        engine,
        app[CONFIG],
        len(prompts),
        app[DRAINING].is_set(),
        admission,
        sum(prompt_work),
        max(answer_work) // params.n,
        len(prompts) * params.n,
        tenant(request),
    )
    # NOTE: a client may reuse an X-Request-Id; engine ids must still be unique.
    engine_id = f"{prefix}-{request_id(request)}-{uuid.uuid4().hex[:8]}"
    job = GenerationJob(
        engine_id, prompts, params, tenant(request), (prompt_work, answer_work), reuse=reuse
    )
    reading = app[DOCUMENTS].readers.current()
    if reading is not None:  # a DELETE of its documents waits until the engine has it
        reading.expect(len(prompts))
        job.on_queued = reading.note_queued
    return job


# -- /v1/chat/completions ------------------------------------------------------------------
async def chat_completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    body = await parse_request(request, ChatCompletionRequest)
    model, documents = await _prepare(request, body)
    prompts = app[PROMPTS]
    messages = body.template_messages()
    prompts.text_limit.check([m["content"] for m in messages], "messages")
    ids = await prompts.run(prompts.chat_ids, messages, documents)
    max_tokens, param = body.max_tokens, "max_tokens"
    if body.max_completion_tokens is not None:
        max_tokens, param = body.max_completion_tokens, "max_completion_tokens"
    check_context([len(ids)], max_tokens, app[ENGINE].max_model_len, "messages", param)
    top_n = body.top_logprobs or 0
    params = _sampling_params(body, max_tokens, top_n if body.logprobs else None)
    job = _job(request, "chatcmpl", [ids], params, body.documents, _reuse(request, body, documents))
    public_id = f"chatcmpl-{request_id(request)}"
    created = int(time.time())
    text_of = TokenText(prompts.tokenizer)
    base = {"id": public_id, "object": "chat.completion.chunk", "created": created, "model": model}

    if not body.stream:
        outputs = await _collect(request, job, CHAT_ENDPOINT)
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c, 0, len(c.token_ids), top_n, text_of),
                "finish_reason": finish_reason(c),
            }
            for c in outputs[0].outputs
        ]
        response = {
            **base,
            "object": "chat.completion",
            "choices": choices,
            "usage": usage(outputs, _notes(request, body.documents, outputs)),
        }
        return web.json_response(response)

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    extra = {"usage": None} if include_usage else {}

    async def emit(prompt_index: int, output: RequestOutput, state: StreamState) -> None:
        for c in output.outputs:
            cursor = state.cursor(c.index)
            if cursor.finished:
                continue
            delta: dict[str, Any] = {}
            if not cursor.started:
                delta["role"] = "assistant"
            new_text = c.text[cursor.text_len :]
            reason = finish_reason(c)
            new_tokens = len(c.token_ids) > cursor.num_tokens and body.logprobs
            if not (new_text or reason or new_tokens or not cursor.started):
                continue
            delta["content"] = new_text
            choice = {
                "index": c.index,
                "delta": delta,
                "logprobs": chat_logprobs(c, cursor.num_tokens, len(c.token_ids), top_n, text_of),
                "finish_reason": reason,
            }
            cursor.started, cursor.finished = True, reason is not None
            cursor.text_len, cursor.num_tokens = len(c.text), len(c.token_ids)
            await sse.send({**base, "choices": [choice], **extra})

    sse = SSEWriter(request, request_id(request))
    usage_chunk = {**base, "choices": []} if include_usage else None
    return await _stream(request, job, CHAT_ENDPOINT, sse, emit, usage_chunk, body.documents)


# -- /v1/completions -----------------------------------------------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    body = await parse_request(request, CompletionRequest)
    raw_prompts = body.prompt_list()
    if not raw_prompts:
        raise bad_request("prompt must not be an empty list", "prompt")
    if len(raw_prompts) > MAX_BATCH_PROMPTS:
        raise bad_request(
            f"at most {MAX_BATCH_PROMPTS} prompts per request, got {len(raw_prompts)}", "prompt"
        )
    model, documents = await _prepare(request, body, len(raw_prompts))
    prompts = app[PROMPTS]
    for prompt in raw_prompts:
        if isinstance(prompt, str):
            prompts.text_limit.check([prompt], "prompt")
    ids_list = [await prompts.run(prompts.completion_ids, p, documents) for p in raw_prompts]
    max_model_len = app[ENGINE].max_model_len
    check_context([len(ids) for ids in ids_list], body.max_tokens, max_model_len, "prompt")
    max_tokens = body.max_tokens
    if max_tokens is None:
        room = max_model_len - max(len(ids) for ids in ids_list)
        max_tokens = min(app[CONFIG].completion_default_max_tokens, room)
    top_n = body.logprobs or 0
    params = _sampling_params(body, max_tokens, body.logprobs)
    job = _job(request, "cmpl", ids_list, params, body.documents, _reuse(request, body, documents))
    public_id = f"cmpl-{request_id(request)}"
    text_of = TokenText(prompts.tokenizer)
    base = {
        "id": public_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
    }
    n = body.n

    if not body.stream:
        outputs = await _collect(request, job, COMPLETIONS_ENDPOINT)
        choices = []
        for prompt_index, output in enumerate(outputs):
            for c in output.outputs:
                logprobs = completion_logprobs(
                    c, 0, len(c.token_ids), top_n, text_of, TextOffsets()
                )
                choices.append(
                    {
                        "index": prompt_index * n + c.index,
                        "text": c.text,
                        "logprobs": logprobs,
                        "finish_reason": finish_reason(c),
                    }
                )
        totals = usage(outputs, _notes(request, body.documents, outputs))
        return web.json_response({**base, "choices": choices, "usage": totals})

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    extra = {"usage": None} if include_usage else {}

    async def emit(prompt_index: int, output: RequestOutput, state: StreamState) -> None:
        for c in output.outputs:
            index = prompt_index * n + c.index
            cursor = state.cursor(index)
            if cursor.finished:
                continue
            new_text = c.text[cursor.text_len :]
            reason = finish_reason(c)
            new_tokens = len(c.token_ids) > cursor.num_tokens and body.logprobs is not None
            if not (new_text or reason or new_tokens):
                continue
            logprobs = completion_logprobs(
                c, cursor.num_tokens, len(c.token_ids), top_n, text_of, cursor.text_offsets
            )
            choice = {
                "index": index,
                "text": new_text,
                "logprobs": logprobs,
                "finish_reason": reason,
            }
            cursor.finished = reason is not None
            cursor.text_len, cursor.num_tokens = len(c.text), len(c.token_ids)
            await sse.send({**base, "choices": [choice], **extra})

    sse = SSEWriter(request, request_id(request))
    usage_chunk = {**base, "choices": []} if include_usage else None
    return await _stream(request, job, COMPLETIONS_ENDPOINT, sse, emit, usage_chunk, body.documents)


# -- running -------------------------------------------------------------------------------
def _notes(
    request: web.Request, doc_ids: list[str] | None, outputs: list[RequestOutput]
) -> list[dict[str, Any]]:
    return document_notes(request.app[DOCUMENTS], tenant(request), doc_ids or [], outputs)


def _run(
    app: web.Application, job: GenerationJob, endpoint: str
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """``run_job``'s outputs; the caller must close the iterator (``contextlib.aclosing``)."""
    stream = run_job(app[ENGINE], job, app[METRICS], endpoint, app[ADMISSION])
    return _held_in_flight(app[REQUESTS_IN_FLIGHT], job, stream)


async def _held_in_flight(
    in_flight: RequestsInFlight,
    job: GenerationJob,
    stream: AsyncGenerator[tuple[int, RequestOutput], None],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """``stream``, the job's prompts counted in flight for its tenant from the first item
    asked for until it is closed (closing this closes ``stream``)."""
    async with contextlib.aclosing(stream):
        with in_flight.hold(job.namespace, len(job.prompts)):
            async for item in stream:
                yield item


async def _collect(request: web.Request, job: GenerationJob, endpoint: str) -> list[RequestOutput]:
    app = request.app
    started = time.perf_counter()
    finals: dict[int, RequestOutput] = {}
    stream = _run(app, job, endpoint)
    async with contextlib.aclosing(stream):
        async for index, output in stream:
            if output.finished:
                finals[index] = output
    outputs = [finals[i] for i in range(len(job.prompts))]
    _log_finished(request, endpoint, outputs, started)
    return outputs


async def _stream(
    request: web.Request,
    job: GenerationJob,
    endpoint: str,
    sse: SSEWriter,
    emit: Emit,
    usage_chunk: dict[str, Any] | None,
    doc_ids: list[str] | None,
) -> web.StreamResponse:
    """Stream chunks. Errors before the first output are ordinary error responses; later
    ones become an error event followed by ``[DONE]``."""
    app = request.app
    started = time.perf_counter()
    state = StreamState()
    stream = _run(app, job, endpoint)
    async with contextlib.aclosing(stream):
        # NOTE: wait for the first output before sending headers, so a request the engine
        # rejects still gets its 4xx status.
        first = await anext(stream)
        await sse.start()
        try:
            await _emit_output(emit, first, state)
            async for item in stream:
                await _emit_output(emit, item, state)
            finals = [state.finals[i] for i in range(len(job.prompts))]
            if usage_chunk is not None:
                totals = usage(finals, _notes(request, doc_ids, finals))
                await sse.send({**usage_chunk, "usage": totals})
            await sse.done()
            _log_finished(request, endpoint, finals, started)
        except ConnectionResetError:
            logger.info("request %s: the client went away; aborting", request_id(request))
        except APIError as exc:
            await _send_error(sse, exc.status, exc.message, exc.param, exc.code)
        except EngineRequestError as exc:
            error = from_engine_error(exc)
            await _send_error(sse, error.status, error.message, None, error.code)
        except Exception:
            logger.exception("request %s failed while streaming", request_id(request))
            message = (
                f"internal server error (request id {request_id(request)}); see the server log"
            )
            await _send_error(sse, 500, message, None, "internal_error")
    return sse.response


async def _emit_output(emit: Emit, item: tuple[int, RequestOutput], state: StreamState) -> None:
    index, output = item
    await emit(index, output, state)
    if output.finished:
        state.finals[index] = output


async def _send_error(
    sse: SSEWriter, status: int, message: str, param: str | None, code: str | None
) -> None:
    with contextlib.suppress(ConnectionResetError):
        await sse.send(error_body(status, message, param, code))
        await sse.done()


def _log_finished(
    request: web.Request, endpoint: str, outputs: list[RequestOutput], started: float
) -> None:
    totals = usage(outputs)
    logger.info(
        "request %s %s: %d prompt tokens (%d cached), %d generated, %.2f s",
        request_id(request),
        endpoint,
        totals["prompt_tokens"],
        totals["prompt_tokens_details"]["cached_tokens"],
        totals["completion_tokens"],
        time.perf_counter() - started,
    )
