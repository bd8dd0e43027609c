"""How a request's documents may reuse cached KV: a value passed with a request."""

from __future__ import annotations

from dataclasses import dataclass

KV_REUSE_MODES = ("prefix", "blend")


@dataclass(frozen=True)
class DocumentReuse:
    """The documents' token spans ``(start, end)`` in the prompt, and how their KV may be
    reused: ``kv_reuse`` "prefix" (exact prefix hits only) or "blend" (also documents at
    other positions, recomputing ``recompute_ratio`` of each); None: the engine's default.
    """

    documents: tuple[tuple[int, int], ...]
    kv_reuse: str | None = None
    recompute_ratio: float | None = None
