"""Blend quality against full prefill, teacher-forced through transformers (float32).

For a prompt ``template + doc_1..doc_n + question`` this emulates what the engine computes:
the leading run (template + doc_1) exact, every later document's KV taken from its
segment (computed after the template alone) with keys rotated to the new position, and a
selected set of tokens recomputed with attention over everything before them (the stale
KV of a recomputed token is masked out, its fresh KV used instead). One forward pass over
the recomputed tokens, the question and the full-prefill answer gives the next-token
distributions of the answer's tokens: the full prefill's greedy answer up to and including
its end-of-turn token, at most ``answer_len`` tokens. (Forcing the answer past its end
scored tokens the model was made to write after it had finished: there the reference
itself is no greedy choice, and near-uniform distributions swamp the KL.)

Selection rules compared at the same token budget (``ceil(r * len)`` per blended document):
``leading`` recomputes each document's first tokens (what the engine does: it keeps
positions monotonic); ``deviation`` recomputes the tokens whose layer-1 KV deviates most
from the full-context KV (CacheBlend's rule; one layer over every token to compute).
Segments store only full blocks: a document's last partial block is always recomputed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ragserve.bench.rag_workload import RagQuestion


@dataclass
class Reference:
    answer: list[int]  # the full prefill's greedy answer
    logprobs: torch.Tensor  # [len(answer), vocab] float32, teacher-forced
    keys: list[torch.Tensor]  # per layer [kv_heads, prompt_len, head_dim]
    values: list[torch.Tensor]


@dataclass
class Score:
    exact: bool  # greedy answer identical to the full prefill's
    kl: float  # mean KL(full || this) over the answer tokens


class BlendEmulator:
    def __init__(self, model: Any, block_size: int = 16) -> None:
        self.model = model
        self.block_size = block_size
        self._segments: dict[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    @torch.inference_mode()
    def reference(self, question: RagQuestion, answer_len: int) -> Reference:
        ids = torch.tensor([question.token_ids], device=self.device)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=answer_len,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        answer = out.sequences[0, ids.shape[1] :].tolist()
        logprobs = torch.log_softmax(torch.cat(out.logits).float(), dim=-1)
        n = ids.shape[1]
        cache = out.past_key_values
        keys = [layer.keys[0, :, :n].float() for layer in cache.layers]
        values = [layer.values[0, :, :n].float() for layer in cache.layers]
        return Reference(answer, logprobs, keys, values)

    @torch.inference_mode()
    def logprobs_of(self, token_ids: list[int], answer: list[int]) -> torch.Tensor:
        """Teacher-forced next-token logprobs of ``answer`` after ``token_ids`` (full prefill)."""
        ids = torch.tensor([token_ids + answer[:-1]], device=self.device)
        logits = self.model(input_ids=ids).logits[0, len(token_ids) - 1 :]
        return torch.log_softmax(logits.float(), dim=-1)

    def _segment(self, template: list[int], doc: list[int]) -> tuple[list[torch.Tensor], ...]:
        key = (len(template), *template, *doc)
        if key not in self._segments:
            ids = torch.tensor([template + doc], device=self.device)
            out = self.model(input_ids=ids, use_cache=True)
            layers = out.past_key_values.layers
            start = len(template)
            self._segments[key] = (
                [layer.keys[0, :, start:].float() for layer in layers],
                [layer.values[0, :, start:].float() for layer in layers],
            )
        return self._segments[key]

    def _rotate(self, keys: torch.Tensor, shift: int) -> torch.Tensor:
        """Keys ``[heads, n, dim]`` moved ``shift`` positions, with transformers' own RoPE."""
        # NOTE: imported here: the bench's parser imports this module, and ``--help`` is slow
        # enough with torch alone.
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        positions = torch.full((1, keys.shape[1]), shift, device=keys.device)
        cos, sin = self.model.model.rotary_emb(keys[None], positions)
        moved, _ = apply_rotary_pos_emb(keys[None], keys[None], cos, sin)
        return moved[0]

    def candidates(self, question: RagQuestion) -> list[list[int]]:
        """Per blended document: the prompt positions its segment can serve."""
        template = question.spans[0][0]
        out = []
        for start, end in question.spans[1:]:
            stored = (template + end - start) // self.block_size * self.block_size - template
            out.append(list(range(start, start + max(0, stored))))
        return out

    def select(
        self, question: RagQuestion, ratio: float, rule: str, reference: Reference
    ) -> set[int]:
        """Positions (among the candidates) recomputed at ``ratio`` by ``rule``."""
        per_doc = self.candidates(question)
        budgets = [
            min(len(c), math.ceil(ratio * (end - start)))
            for c, (start, end) in zip(per_doc, question.spans[1:], strict=True)
        ]
        if rule == "leading":
            return {p for c, k in zip(per_doc, budgets, strict=True) for p in c[:k]}
        blended_k, blended_v = self._blended_layer(question, 1)
        deviation = (reference.keys[1] - blended_k).pow(2).sum(dim=(0, 2)) + (
            reference.values[1] - blended_v
        ).pow(2).sum(dim=(0, 2))
        flat = [p for c in per_doc for p in c]
        if not flat:
            return set()
        scores = deviation[torch.tensor(flat, device=deviation.device)]
        top = torch.topk(scores, sum(budgets)).indices.tolist()
        return {flat[i] for i in top}

    def _blended_layer(self, question: RagQuestion, layer: int) -> tuple[torch.Tensor, ...]:
        keys, values = self._blended_kv(question, [layer])
        return keys[0], values[0]

    def _blended_kv(
        self, question: RagQuestion, layers: list[int], reference: Reference | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per layer ``[kv_heads, prompt_len, dim]``: exact KV (from ``reference``) up to the
        second document, rotated segment KV for later documents' tokens, zeros elsewhere."""
        ids = question.token_ids
        template = ids[: question.spans[0][0]]
        out_k, out_v = [], []
        for layer in layers:
            shape = (self._kv_heads, len(ids), self._head_dim)
            k = torch.zeros(shape, device=self.device)
            v = torch.zeros(shape, device=self.device)
            if reference is not None:
                lead = question.spans[1][0]
                k[:, :lead], v[:, :lead] = (
                    reference.keys[layer][:, :lead],
                    reference.values[layer][:, :lead],
                )
            for start, end in question.spans[1:]:
                seg_k, seg_v = self._segment(template, ids[start:end])
                shift = start - len(template)
                k[:, start:end] = self._rotate(seg_k[layer], shift)
                v[:, start:end] = seg_v[layer]
            out_k.append(k)
            out_v.append(v)
        return out_k, out_v

    @property
    def device(self) -> torch.device:
        return torch.device(self.model.device)

    @property
    def _kv_heads(self) -> int:
        return int(self.model.config.num_key_value_heads)

    @property
    def _head_dim(self) -> int:
        config = self.model.config
        return int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )

    @torch.inference_mode()
    def blended(
        self, question: RagQuestion, selected: set[int], reference: Reference
    ) -> torch.Tensor:
        """Teacher-forced logprobs of the reference answer under blended KV."""
        ids = question.token_ids
        n = len(ids)
        served = {p for c in self.candidates(question) for p in c} - selected
        lead = question.spans[1][0]
        recompute = [p for p in range(lead, n) if p not in served]
        layers = list(range(self.model.config.num_hidden_layers))
        keys, values = self._blended_kv(question, layers, reference)
        from transformers import DynamicCache

        cache = DynamicCache()
        for layer in layers:
            cache.update(keys[layer][None], values[layer][None], layer)
        positions = recompute + list(range(n, n + len(reference.answer) - 1))
        new_ids = [ids[p] for p in recompute] + reference.answer[:-1]
        dev = self.device
        pos = torch.tensor(positions, device=dev)
        valid_past = torch.zeros(n, dtype=torch.bool, device=dev)
        valid_past[:lead] = True
        valid_past[torch.tensor(sorted(served), dtype=torch.int64, device=dev)] = True
        allowed_past = valid_past[None, :] & (torch.arange(n, device=dev)[None, :] < pos[:, None])
        allowed_new = pos[None, :] <= pos[:, None]
        allowed = torch.cat([allowed_past, allowed_new], dim=1)
        mask = torch.zeros(allowed.shape, dtype=self.model.dtype, device=dev)
        mask[~allowed] = torch.finfo(self.model.dtype).min
        out = self.model(
            input_ids=torch.tensor([new_ids], device=dev),
            position_ids=pos[None],
            attention_mask=mask[None, None],
            past_key_values=cache,
            use_cache=True,
        )
        first = len(recompute) - 1
        return torch.log_softmax(out.logits[0, first:].float(), dim=-1)


def score(reference: Reference, logprobs: torch.Tensor) -> Score:
    answer = torch.tensor(reference.answer, device=logprobs.device)
    exact = bool((logprobs.argmax(dim=-1) == answer).all())
    p = reference.logprobs
    kl = (p.exp() * (p - logprobs)).sum(dim=-1).mean().item()
    return Score(exact, max(0.0, kl))
