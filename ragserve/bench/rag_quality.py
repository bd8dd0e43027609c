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

Selection rules compared at the same budget, ``ceil(r * len)`` tokens of each blended
document summed (``leading`` spends each document's share on it; the others choose across
documents):

- ``leading``: each document's first tokens (what the engine does: positions stay
  monotonic, so the recompute runs as ordinary prefill chunks);
- ``deviation``: the tokens whose layer-1 KV deviates most from the full-context KV
  (CacheBlend's rule; one layer over every token to compute);
- ``attention``: the tokens the question attends to most when the documents' KV is reused
  as it is (summed over layers, heads and question tokens): what the answer reads;
- ``full-deviation``: the tokens whose KV deviates most from the full prefill's over every
  layer. Only an emulator has the full prefill's KV, so no engine can run it: it shows
  what CacheBlend's criterion gives when it is measured exactly.

Segments store only full blocks: a document's last partial block is always recomputed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ragserve.bench.rag_workload import RagQuestion

RULES = ("leading", "deviation", "attention", "full-deviation")


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
        # NOTE: a rule's scores depend on the prompt only, not on r: computed once per prompt
        self._scored: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

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

    @torch.inference_mode()
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

    @torch.inference_mode()
    def select(
        self, question: RagQuestion, ratio: float, rule: str, reference: Reference
    ) -> set[int]:
        """Positions (among the candidates) recomputed at ``ratio`` by ``rule``."""
        if rule not in RULES:
            raise ValueError(f"unknown selection rule {rule!r} (choose from {', '.join(RULES)})")
        per_doc = self.candidates(question)
        budgets = [
            min(len(c), math.ceil(ratio * (end - start)))
            for c, (start, end) in zip(per_doc, question.spans[1:], strict=True)
        ]
        if rule == "leading":
            return {p for c, k in zip(per_doc, budgets, strict=True) for p in c[:k]}
        flat = [p for c in per_doc for p in c]
        if not flat or not sum(budgets):
            return set()
        key = (rule, tuple(question.token_ids))
        if key not in self._scored:
            self._scored[key] = self._scores(question, rule, reference)
        scores = self._scored[key]
        top = torch.topk(scores[torch.tensor(flat, device=scores.device)], sum(budgets))
        return {flat[i] for i in top.indices.tolist()}

    def _scores(self, question: RagQuestion, rule: str, reference: Reference) -> torch.Tensor:
        """Per prompt position: how much recomputing it is worth under ``rule``."""
        if rule == "deviation":
            return self._deviation(question, reference, [1])
        if rule == "full-deviation":
            return self._deviation(question, reference, list(range(self._layers)))
        return self._question_attention(question, reference)

    def _deviation(
        self, question: RagQuestion, reference: Reference, layers: list[int]
    ) -> torch.Tensor:
        """Squared distance of blended from full-prefill KV, each layer scaled by its mean
        squared norm so that no layer's magnitude dominates the sum."""
        keys, values = self._blended_kv(question, layers)
        total = torch.zeros(len(question.token_ids), device=self.device)
        for layer, k, v in zip(layers, keys, values, strict=True):
            ref_k, ref_v = reference.keys[layer], reference.values[layer]
            scale = (ref_k.pow(2) + ref_v.pow(2)).sum(dim=(0, 2)).mean()
            total += ((ref_k - k).pow(2) + (ref_v - v).pow(2)).sum(dim=(0, 2)) / scale
        return total

    @torch.inference_mode()
    def _question_attention(self, question: RagQuestion, reference: Reference) -> torch.Tensor:
        """Attention of the question's tokens to each earlier position, every document's
        KV reused from its segment (its last partial block too, which ``blended`` always
        recomputes)."""
        ids = question.token_ids
        end = question.spans[-1][1]
        out = self._forward_over(
            question, list(range(end, len(ids))), set(range(end)), reference, attend=True
        )
        weights = torch.stack([a[0].sum(dim=(0, 1)) for a in out.attentions]).sum(dim=0)
        return weights[: len(ids)]

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
        n = len(question.token_ids)
        lead = question.spans[1][0]
        served = {p for c in self.candidates(question) for p in c} - selected
        recompute = [p for p in range(lead, n) if p not in served]
        out = self._forward_over(
            question, recompute, served | set(range(lead)), reference, reference.answer[:-1]
        )
        first = len(recompute) - 1
        return torch.log_softmax(out.logits[0, first:].float(), dim=-1)

    def _forward_over(
        self,
        question: RagQuestion,
        recompute: list[int],
        served: set[int],
        reference: Reference,
        answer: list[int] | tuple[int, ...] = (),
        attend: bool = False,
    ) -> Any:
        """One forward pass over the prompt's tokens at ``recompute`` and then ``answer``
        (past the prompt), attending to the blended KV of the ``served`` positions: exact
        before the second document, rotated segments after it."""
        from transformers import DynamicCache

        ids = question.token_ids
        n = len(ids)
        layers = list(range(self._layers))
        keys, values = self._blended_kv(question, layers, reference)
        cache = DynamicCache()
        for layer in layers:
            cache.update(keys[layer][None], values[layer][None], layer)
        dev = self.device
        positions = torch.tensor(recompute + list(range(n, n + len(answer))), device=dev)
        valid_past = torch.zeros(n, dtype=torch.bool, device=dev)
        valid_past[torch.tensor(sorted(served), dtype=torch.int64, device=dev)] = True
        allowed_past = valid_past[None, :] & (
            torch.arange(n, device=dev)[None, :] < positions[:, None]
        )
        allowed_new = positions[None, :] <= positions[:, None]
        allowed = torch.cat([allowed_past, allowed_new], dim=1)
        mask = torch.zeros(allowed.shape, dtype=self.model.dtype, device=dev)
        mask[~allowed] = torch.finfo(self.model.dtype).min
        return self.model(
            input_ids=torch.tensor([[ids[p] for p in recompute] + list(answer)], device=dev),
            position_ids=positions[None],
            attention_mask=mask[None, None],
            past_key_values=cache,
            use_cache=True,
            output_attentions=attend,
        )

    @property
    def _layers(self) -> int:
        return int(self.model.config.num_hidden_layers)


def score(reference: Reference, logprobs: torch.Tensor) -> Score:
    answer = torch.tensor(reference.answer, device=logprobs.device)
    exact = bool((logprobs.argmax(dim=-1) == answer).all())
    p = reference.logprobs
    kl = (p.exp() * (p - logprobs)).sum(dim=-1).mean().item()
    return Score(exact, max(0.0, kl))
