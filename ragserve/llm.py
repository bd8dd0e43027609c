"""The synchronous offline API, compatible with vLLM's ``LLM`` for the common subset."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from ragserve.config import EngineConfig
from ragserve.engine.engine_info import EngineInfo, EngineSnapshot
from ragserve.engine.llm_engine import LLMEngine
from ragserve.outputs import RequestOutput
from ragserve.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]
Message = dict[str, str]


def _prompt_value(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return str(prompt["prompt"])
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return prompt  # NOTE: the engine checks and converts token ids (LLMEngine.tokenize)
    raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a string, a token-id list or a prompt dict) or a list of them."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # type: ignore[list-item]
    return items  # type: ignore[return-value]


class LLM:
    """``LLM(model=None)`` serves the embedded default model (SmolLM2-135M-Instruct).

    Every keyword of :class:`ragserve.config.EngineConfig` is accepted.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        unknown = sorted(set(engine_args) - {f.name for f in dataclasses.fields(EngineConfig)})
        if unknown:
            raise ValueError(f"unknown engine argument: {', '.join(unknown)}")
        try:
            config = EngineConfig(model=model, **engine_args)
        except TypeError as exc:  # NOTE: a value of the wrong type, compared or converted
            raise ValueError(f"an engine argument has the wrong type: {exc}") from None
        self.engine = LLMEngine(config, offline=True)
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config, offline=True)
        llm._ids = itertools.count()
        return llm

    def close(self) -> None:
        """Flush the KV disk tier and release the engine's tiers."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def info(self) -> EngineInfo:
        """What the engine is: model, device, KV cache and tier layout (fixed for its life)."""
        return self.engine.info

    def snapshot(self) -> EngineSnapshot:
        """The engine's counters now, as a copy (see :class:`EngineSnapshot`)."""
        return self.engine.snapshot()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> int:
        """Drop every cached block not in use. Returns how many were dropped."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        namespace: str = "",
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched continuously; results in prompt order.

        A prompt that fails while running (a fault of its own) does not stop the others: its
        output comes back finished with ``error`` set. Invalid prompts or parameters raise
        ``ValueError`` before anything runs.
        """
        prompt_list = [_prompt_value(p) for p in _as_prompt_list(prompts)]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            if not isinstance(sampling_params, Sequence) or not all(
                isinstance(params, SamplingParams) for params in sampling_params
            ):
                raise TypeError(
                    "sampling_params must be a SamplingParams or a sequence of them, got "
                    f"{type(sampling_params).__name__}"
                )
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling params for {len(prompt_list)} prompts"
                )
        return self._run(prompt_list, params_list, use_tqdm, namespace)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this model has no tokenizer, so it cannot chat")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = []
        for conversation in conversations:
            ids = tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                tokenize=True,
                return_dict=False,
            )
            prompts.append(list(ids))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(
        self,
        prompts: list[str | list[int]],
        params_list: list[SamplingParams],
        use_tqdm: bool,
        namespace: str,
    ) -> list[RequestOutput]:
        engine = self.engine
        request_ids: list[str] = []
        try:
            for index, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                request_id = f"offline-{next(self._ids)}"
                try:
                    engine.add_request(request_id, prompt, params, namespace=namespace)
                except ValueError as exc:
                    where = f"prompt {index}: " if len(prompts) > 1 else ""
                    raise ValueError(f"{where}{exc}") from None
                request_ids.append(request_id)
        except BaseException:  # NOTE: none of them is left to run in a later call
            for request_id in request_ids:
                engine.abort_request(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="generating", unit="req", disable=not use_tqdm)
        generated = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:  # NOTE: a failed request too, its error on its output
                        finished[output.request_id] = output
                        generated += sum(len(c.token_ids) for c in output.outputs)
                        progress.update(1)
                        progress.set_postfix(tokens=generated, refresh=False)
        except BaseException:
            for request_id in request_ids:
                engine.abort_request(request_id)
            raise
        finally:
            progress.close()
        return [finished[request_id] for request_id in request_ids]
