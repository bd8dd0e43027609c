"""The OpenAPI 3.1 description of every route: request bodies from the pydantic models."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import BaseModel

import ragserve
from ragserve.server.document_lifecycle import DocumentPatch
from ragserve.server.pipeline_routes import SummarizeRequest
from ragserve.server.protocol import ChatCompletionRequest, CompletionRequest, DocumentRequest
from ragserve.server.state import CONFIG

_REF = "#/components/schemas/{model}"
_JSON = "application/json"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


def _json_body(name: str) -> dict[str, Any]:
    return {"required": True, "content": {_JSON: {"schema": _ref(name)}}}


_ERROR = {"description": "error", "content": {_JSON: {"schema": _ref("ErrorResponse")}}}
_OBJECT = {"content": {_JSON: {"schema": {"type": "object"}}}}
_ID_PARAM = {
    "name": "id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
}
_MODEL_PARAM = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
_GENERATION_RESPONSES = {
    "200": {
        "description": "the completion, or server-sent events when stream is true",
        "content": {
            _JSON: {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    },
    "400": _ERROR,
    "404": _ERROR,
    "429": _ERROR,
    "503": _ERROR,
}

# (method, path) -> operation; every route the app registers must appear here.
OPERATIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("get", "/health"): {
        "summary": "200 while the engine runs, 503 otherwise",
        "responses": {
            "200": {"description": "healthy", **_OBJECT},
            "503": {"description": "unhealthy"},
        },
    },
    ("get", "/metrics"): {
        "summary": "Prometheus metrics",
        "responses": {
            "200": {
                "description": "metrics",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
    },
    ("get", "/openapi.json"): {
        "summary": "This document",
        "responses": {"200": {"description": "the OpenAPI description", **_OBJECT}},
    },
    ("get", "/v1/models"): {
        "summary": "List the served model",
        "responses": {"200": {"description": "model list", **_OBJECT}},
    },
    ("get", "/v1/models/{model}"): {
        "summary": "Describe the served model",
        "parameters": [_MODEL_PARAM],
        "responses": {"200": {"description": "model", **_OBJECT}, "404": _ERROR},
    },
    ("post", "/v1/completions"): {
        "summary": "OpenAI completions; 'documents' puts uploaded documents first",
        "requestBody": _json_body("CompletionRequest"),
        "responses": _GENERATION_RESPONSES,
    },
    ("post", "/v1/chat/completions"): {
        "summary": "OpenAI chat completions; 'documents' puts uploaded documents first",
        "requestBody": _json_body("ChatCompletionRequest"),
        "responses": _GENERATION_RESPONSES,
    },
    ("post", "/v1/documents"): {
        "summary": "Upload a document; it is prefilled in the background and its blocks pinned",
        "requestBody": {
            "required": True,
            "content": {
                _JSON: {"schema": _ref("DocumentRequest")},
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["file"],
                        "properties": {
                            "file": {
                                "type": "string",
                                "format": "binary",
                                "description": "a UTF-8 .txt or .md file",
                            },
                            "metadata": {"type": "string", "description": "a JSON object"},
                            "ttl": {"type": "string", "description": "seconds from now"},
                            "expire_time": {
                                "type": "string",
                                "description": "Unix seconds or an RFC 3339 time",
                            },
                        },
                    }
                },
            },
        },
        "responses": {
            "200": {"description": "already known: its current state", **_OBJECT},
            "202": {"description": "new: ingesting", **_OBJECT},
            "400": _ERROR,
            "413": _ERROR,
            "415": _ERROR,
            "429": _ERROR,
            "503": _ERROR,
        },
    },
    ("get", "/v1/documents"): {
        "summary": "List the caller's documents",
        "responses": {"200": {"description": "document list", **_OBJECT}},
    },
    ("get", "/v1/documents/{id}"): {
        "summary": "A document's state (ingesting, ready or failed), create and expire "
        "times, tokens, blocks pinned, and its KV blocks per place (device, CPU, disk, remote)",
        "parameters": [_ID_PARAM],
        "responses": {"200": {"description": "document", **_OBJECT}, "400": _ERROR, "404": _ERROR},
    },
    ("patch", "/v1/documents/{id}"): {
        "summary": "Change a document's ttl / expire_time (null: never expires) or metadata",
        "parameters": [_ID_PARAM],
        "requestBody": _json_body("DocumentPatch"),
        "responses": {"200": {"description": "document", **_OBJECT}, "400": _ERROR, "404": _ERROR},
    },
    ("delete", "/v1/documents/{id}"): {
        "summary": "Forget a document: unpin it, delete its row, purge its KV from every tier",
        "parameters": [_ID_PARAM],
        "responses": {"200": {"description": "deleted", **_OBJECT}, "400": _ERROR, "404": _ERROR},
    },
    ("post", "/v1/pipelines/summarize"): {
        "summary": "Start a map-reduce summarization job on texts or uploaded documents; "
        "it runs in the background on the serving engine",
        "requestBody": _json_body("SummarizeRequest"),
        "responses": {
            "202": {"description": "the job, queued or running", **_OBJECT},
            "400": _ERROR,
            "404": _ERROR,
            "413": _ERROR,
            "415": _ERROR,
            "429": _ERROR,
            "503": _ERROR,
        },
    },
    ("get", "/v1/pipelines/summarize"): {
        "summary": "List the caller's summarization jobs, oldest first",
        "responses": {"200": {"description": "job list", **_OBJECT}},
    },
    ("get", "/v1/pipelines/summarize/{id}"): {
        "summary": "A job's status (queued, running, succeeded, failed, cancelled), progress, "
        "and the results of its finished documents",
        "parameters": [_ID_PARAM],
        "responses": {"200": {"description": "job", **_OBJECT}, "404": _ERROR},
    },
    ("delete", "/v1/pipelines/summarize/{id}"): {
        "summary": "Cancel a queued or running job (its engine requests are aborted); "
        "a finished job is returned unchanged",
        "parameters": [_ID_PARAM],
        "responses": {"200": {"description": "the job", **_OBJECT}, "404": _ERROR},
    },
}

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


def _schemas(models: tuple[type[BaseModel], ...]) -> dict[str, Any]:
    schemas: dict[str, Any] = {"ErrorResponse": _ERROR_SCHEMA}
    for model in models:
        schema = model.model_json_schema(ref_template=_REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return schemas


def build_spec(app: web.Application) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    secured = bool(app[CONFIG].api_keys)
    for (method, path), operation in OPERATIONS.items():
        operation = dict(operation)
        if secured and (path.startswith("/v1") or path in ("/metrics", "/openapi.json")):
            operation["security"] = [{"bearer": []}]
            operation["responses"] = {**operation["responses"], "401": _ERROR}
        paths.setdefault(path, {})[method] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "ragserve", "version": ragserve.__version__},
        "paths": paths,
        "components": {
            "schemas": _schemas(
                (
                    CompletionRequest,
                    ChatCompletionRequest,
                    DocumentRequest,
                    DocumentPatch,
                    SummarizeRequest,
                )
            ),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
