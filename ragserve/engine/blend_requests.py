"""A request's choice of KV reuse for its documents, and the segments it needs computed.

``kv_reuse`` "prefix" reuses exact prefix hits only; "blend" also reuses each later
document's segment at its new position (see :mod:`ragserve.engine.blend_plan`). A segment
that no cache holds is computed once by an internal request queued ahead of the one that
needs it; the blended request waits for it at its install (a computed segment then serves
every later prompt that names the document, in any order).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.kv_cache_manager import KVCacheManager
from kvstore.segments import Segment, segment_stored
from ragserve.config import EngineConfig
from ragserve.document_reuse import KV_REUSE_MODES
from ragserve.engine.blend_plan import BlendPlan, check_documents, plan_blend
from ragserve.sampling_params import SamplingParams

# NOTE: a segment request only fills blocks; its one sampled token is dropped.
SEGMENT_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def segment_request_id(segment: Segment) -> str:
    return f"segment-{segment.key.hex()}"


@dataclass
class BlendRequest:
    """The blend plan of one request, copied for each of its sequences."""

    template: BlendPlan

    @classmethod
    def make(
        cls,
        config: EngineConfig,
        salt: bytes,
        token_ids: Sequence[int],
        documents: Sequence[tuple[int, int]] | None,
        kv_reuse: str | None,
        recompute_ratio: float | None,
    ) -> BlendRequest | None:
        """None for prefix reuse, or when nothing would be blended (e.g. one document)."""
        mode = kv_reuse or config.kv_reuse
        if mode not in KV_REUSE_MODES:
            raise ValueError(f"kv_reuse must be one of {', '.join(KV_REUSE_MODES)}, got {mode!r}")
        documents = [(int(start), int(end)) for start, end in documents or ()]
        check_documents(documents, len(token_ids))
        if mode != "blend" or not config.enable_prefix_caching:
            return None
        ratio = config.blend_recompute_ratio if recompute_ratio is None else recompute_ratio
        plan = plan_blend(salt, token_ids, documents, ratio, config.block_size)
        return None if plan is None else cls(plan)

    def plan(self) -> BlendPlan | None:
        """A fresh plan for one sequence (plans track their sequence's progress); None
        when every document is computed."""
        return copy.deepcopy(self.template) if self.template.planned else None

    def take_missing_segments(
        self, manager: KVCacheManager, in_flight: Callable[[Segment], bool]
    ) -> list[Segment]:
        """Segments of the plan that neither the device nor a tier holds, nor a queued
        request is computing (``in_flight``), taken out of the plan.

        NOTE: such a document is computed in place (exact, and no slower than computing
        its segment first); its segment is computed next to the request, for later ones.
        """
        missing: dict[bytes, Segment] = {}
        for install in list(self.template.planned):
            segment = install.segment
            if segment.key in missing or not (
                in_flight(segment) or segment_stored(manager, segment)
            ):
                missing[segment.key] = segment
                self.template.planned.remove(install)
        return list(missing.values())
