"""Sampling that fails one request, never the batch.

A batch draw that raises is retried row by row to find the requests at fault; they fail
alone, and the others draw exactly what they would have drawn without them (each row is
sampled on its own, and generator states are restored before every retry).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ragserve.engine.sampler import DeviceSamples, SampleRequest, sample_on_device, to_device_async
from ragserve.engine.sequence import Sequence

logger = logging.getLogger(__name__)

# Test-only: requests whose id contains this variable's value fail while sampling, to
# exercise the isolation of request faults.
FAIL_SAMPLING_ENV = "RAGSERVE_TEST_FAIL_SAMPLING_MARKER"


class InjectedFault(RuntimeError):
    """Raised by the test-only sampling fault hook (``FAIL_SAMPLING_ENV``)."""


@dataclass
class LaunchedStep:
    """A step queued on the device whose sampled tokens the host has not read yet.

    ``seqs`` are the sequences that sample a token, in row order; ``rows[i]`` is the row
    of ``seqs[i]`` in ``samples`` (None: row ``i``).
    """

    seqs: list[Sequence]
    samples: DeviceSamples | None
    rows: list[int] | None = None

    def row(self, index: int) -> int:
        return index if self.rows is None else self.rows[index]


class GuardedSampler:
    def __init__(self) -> None:
        self.fail_marker: str | None = os.environ.get(FAIL_SAMPLING_ENV) or None

    def sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        requests: list[SampleRequest],
        fail: Callable[[str, str], None],
    ) -> LaunchedStep:
        """Draw a token for each row of ``logits`` (row ``i`` is ``seqs[i]``, drawn as
        ``requests[i]``); ``fail(request_id, message)`` is called for each request at fault."""
        if not seqs:
            return LaunchedStep([], None)
        states = [r.generator.get_state() if r.generator is not None else None for r in requests]
        try:
            return LaunchedStep(seqs, self._draw(logits, requests))
        except Exception:
            logger.warning("sampling a batch of %d rows failed; retrying row by row", len(seqs))
        failed: set[str] = set()
        for row, request in enumerate(requests):
            _restore(requests, states)
            try:
                self._draw(logits[row : row + 1], [request])
            except Exception as exc:
                failed.add(seqs[row].request_id)
                fail(seqs[row].request_id, f"sampling failed: {type(exc).__name__}: {exc}")
        _restore(requests, states)
        keep = [row for row, seq in enumerate(seqs) if seq.request_id not in failed]
        if not keep:
            return LaunchedStep([], None)
        rows = to_device_async(keep, torch.int64, logits.device)
        kept = [requests[row] for row in keep]
        return LaunchedStep([seqs[row] for row in keep], self._draw(logits[rows], kept))

    def _draw(self, logits: torch.Tensor, requests: list[SampleRequest]) -> DeviceSamples:
        if self.fail_marker is not None:
            for request in requests:
                if self.fail_marker in request.request_id:
                    raise InjectedFault(f"injected sampling fault for {request.request_id}")
        return sample_on_device(logits, requests)


def _restore(requests: list[SampleRequest], states: list[torch.Tensor | None]) -> None:
    for request, state in zip(requests, states, strict=True):
        if request.generator is not None and state is not None:
            request.generator.set_state(state)
