"""Request bodies with OpenAI's field names, validated strictly (no silent type coercion).

Unknown fields are ignored, as OpenAI clients send fields we have no use for. Fields we
know but do not implement are accepted only at their neutral value, so a request never
silently means something else. ``documents`` is our extension: ids of uploaded documents
placed, in order, at the start of the prompt.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_INT64 = 2**63
Stop = str | list[str] | None


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class GenerationRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    user: str | None = Field(None, max_length=256)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # Extensions (vLLM's names where vLLM has them).
    documents: list[str] | None = None
    # How the documents' KV is reused: exact prefix hits only, or blended at any position
    # (default: the server's --kv-reuse and --blend-recompute-ratio).
    kv_reuse: Literal["prefix", "blend"] | None = None
    blend_recompute_ratio: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int = -1
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    repetition_penalty: float = 1.0  # not implemented: accepted at its neutral value only
    min_p: float = 0.0  # likewise

    @model_validator(mode="after")
    def _check_common(self) -> GenerationRequest:
        if isinstance(self.stop, list) and len(self.stop) > 16:
            raise ValueError(f"at most 16 stop strings are allowed, got {len(self.stop)}")
        if self.presence_penalty or self.frequency_penalty:
            raise ValueError("presence_penalty and frequency_penalty are not supported (use 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.repetition_penalty != 1.0 or self.min_p:
            raise ValueError("repetition_penalty and min_p are not supported (use 1 and 0)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


class CompletionRequest(GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (leave it unset or equal to n)")
        return self

    def prompt_list(self) -> list[str] | list[list[int]]:
        """The prompts as a batch: one string or token list becomes a batch of one."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [prompt]
        return prompt  # type: ignore[return-value]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def as_template_message(self) -> dict[str, str]:
        # NOTE: "developer" is OpenAI's newer name for "system"; chat templates know "system".
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text()}


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Literal["none"] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.tools:
            raise ValueError("tools are not supported")
        return self

    def template_messages(self) -> list[dict[str, str]]:
        return [message.as_template_message() for message in self.messages]


class DocumentRequest(_Strict):
    text: str = Field(min_length=1)
    metadata: dict[str, Any] = Field(default_factory=dict)
    ttl: float | int | None = None  # seconds; see ragserve.server.document_lifecycle
    expire_time: float | int | str | None = None
