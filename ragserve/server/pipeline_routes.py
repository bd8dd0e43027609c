"""``/v1/pipelines/summarize``: start, inspect, list and cancel map-reduce summarization jobs.

``POST`` validates at once (400 with the numbers for options that cannot work on this
model) and answers 202 with the job; the job runs in the background on the server's
engine (see :mod:`ragserve.server.summarize_jobs`). Jobs belong to the tenant that made
them: any other key gets 404.
"""

from __future__ import annotations

from typing import Annotated, Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipelines.documents import Document
from pipelines.summarize import SummarizeOptions
from ragserve.server.admission_checks import check_admission
from ragserve.server.body import parse_request
from ragserve.server.errors import bad_request
from ragserve.server.prompts import DOCUMENT_CLOSE, DOCUMENT_OPEN
from ragserve.server.request_context import tenant
from ragserve.server.state import (
    ADMISSION,
    CONFIG,
    DOCUMENTS,
    DRAINING,
    ENGINE,
    METRICS,
    PROMPTS,
)
from ragserve.server.summarize_jobs import ENDPOINT, SummarizeJobs
from ragserve.server.tenant_limits import JobLimits
from ragserve.server.text_limits import TextLimit

SUMMARIZE_JOBS: web.AppKey[SummarizeJobs] = web.AppKey("summarize_jobs")
MAX_INPUTS = 64
_INPUTS = ("text", "texts", "documents")


class SummarizeRequest(BaseModel):
    """Exactly one input (``text``, ``texts`` or ``documents``: ids of uploaded documents)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    text: str | None = Field(None, min_length=1)
    texts: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1, max_length=MAX_INPUTS
    )
    documents: list[str] | None = Field(None, min_length=1, max_length=MAX_INPUTS)
    max_summary_tokens: int = Field(128, ge=1)
    chunk_tokens: int | None = Field(
        None, ge=2, description="tokens per map chunk; default: as many as the context allows"
    )
    overlap_tokens: int | None = Field(
        None, ge=0, description="tokens shared by consecutive chunks; default: a tenth, <= 128"
    )
    temperature: float = Field(0.0, ge=0.0, le=2.0)
    seed: int = Field(0, ge=0, lt=2**63)

    @model_validator(mode="after")
    def _one_input(self) -> SummarizeRequest:
        given = [name for name in _INPUTS if getattr(self, name) is not None]
        if len(given) != 1:
            found = " and ".join(given) if given else "none"
            raise ValueError(f"give exactly one of text, texts or documents (got {found})")
        return self

    def options(self) -> SummarizeOptions:
        return SummarizeOptions(
            max_summary_tokens=self.max_summary_tokens,
            chunk_tokens=self.chunk_tokens,
            overlap_tokens=self.overlap_tokens,
            temperature=self.temperature,
            seed=self.seed,
        )


def add_routes(app: web.Application) -> None:
    """Register the routes and the job registry (needs ENGINE, PROMPTS, METRICS, ADMISSION,
    CONFIG)."""
    app[SUMMARIZE_JOBS] = SummarizeJobs(
        app[ENGINE],
        app[PROMPTS],
        app[METRICS],
        app[ADMISSION],
        limits=JobLimits.from_config(app[CONFIG]),
    )
    app.router.add_post(ENDPOINT, create_summarize_job)
    app.router.add_get(ENDPOINT, list_summarize_jobs)
    app.router.add_get(ENDPOINT + "/{id}", get_summarize_job)
    app.router.add_delete(ENDPOINT + "/{id}", cancel_summarize_job)
    app.on_shutdown.append(_cancel_jobs)


async def _cancel_jobs(app: web.Application) -> None:
    await app[SUMMARIZE_JOBS].close()


async def create_summarize_job(request: web.Request) -> web.Response:
    app = request.app
    body = await parse_request(request, SummarizeRequest)
    check_admission(app[ENGINE], app[CONFIG], 1, app[DRAINING].is_set())
    jobs = app[SUMMARIZE_JOBS]
    summarizer = await jobs.summarizer(body.options())
    namespace = tenant(request)
    documents = await _documents(app, namespace, body)
    job = jobs.submit(namespace, documents, summarizer)
    return web.json_response(job.to_json(), status=202)


async def _documents(
    app: web.Application, namespace: str, body: SummarizeRequest
) -> list[Document]:
    """The inputs as pipeline documents; uploaded ones are read back from their tokens."""
    if body.documents is None:
        texts = [body.text] if body.text is not None else body.texts or []
        param = "text" if body.text is not None else "texts"
        # Each text is a document: the same byte bound, checked before any tokenizing.
        limit = TextLimit(app[CONFIG].max_text_bytes)
        for i, text in enumerate(texts):
            limit.check([text], param if body.text is not None else f"{param}[{i}]")
        documents = [Document(str(i), text, f"{param}[{i}]") for i, text in enumerate(texts)]
    else:
        prompts = app[PROMPTS]
        docs = app[DOCUMENTS]
        await docs.learn(namespace, body.documents)  # NOTE: uploaded through another server
        registered = [docs.get(namespace, doc_id, "documents") for doc_id in body.documents]
        param = "documents"
        documents = []
        for i, doc in enumerate(registered):
            text = await prompts.run(_document_text, prompts.tokenizer, doc.token_ids)
            documents.append(Document(doc.id, text, f"documents[{i}]"))
    for i, document in enumerate(documents):
        if not document.text.strip():
            where = param if body.text is not None else f"{param}[{i}]"
            raise bad_request(f"{where} holds only whitespace: nothing to summarize", param)
    return documents


def _document_text(tokenizer: Any, token_ids: list[int]) -> str:
    """An uploaded document's text: its tokens decoded, without the server's wrapper."""
    text = str(tokenizer.decode(token_ids))
    return text.removeprefix(DOCUMENT_OPEN).removesuffix(DOCUMENT_CLOSE)


async def list_summarize_jobs(request: web.Request) -> web.Response:
    jobs = request.app[SUMMARIZE_JOBS].list_for(tenant(request))
    return web.json_response({"object": "list", "data": [job.to_json() for job in jobs]})


async def get_summarize_job(request: web.Request) -> web.Response:
    job = request.app[SUMMARIZE_JOBS].get(tenant(request), request.match_info["id"])
    return web.json_response(job.to_json())


async def cancel_summarize_job(request: web.Request) -> web.Response:
    """Cancel a queued or running job (its engine requests are aborted); a finished one is
    returned as it is."""
    job = await request.app[SUMMARIZE_JOBS].cancel(tenant(request), request.match_info["id"])
    return web.json_response(job.to_json())
