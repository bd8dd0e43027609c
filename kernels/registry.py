"""Picks the attention backend at start-up."""

from __future__ import annotations

import logging

import torch

from kernels.interface import AttentionBackend
from kernels.reference import ReferenceBackend

logger = logging.getLogger(__name__)


def available_backends(device: torch.device) -> list[str]:
    """Backend names usable on ``device``, the default first."""
    names = ["reference"]
    if device.type == "cpu":
        names.insert(0, "cpu")
    if device.type == "cuda":
        try:
            import triton  # noqa: F401

            names.insert(0, "triton")
        except ImportError:
            pass
    return names


def get_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """The named backend, or the best one available on ``device`` when ``name`` is None."""
    choices = available_backends(device)
    chosen = name or choices[0]
    if chosen not in choices:
        raise ValueError(
            f"attention backend {chosen!r} is not available on {device.type}; available: {choices}"
        )
    if chosen == "triton":
        from kernels.triton_backend import TritonBackend

        backend: AttentionBackend = TritonBackend()
    elif chosen == "cpu":
        from kernels.cpu_backend import CpuBackend

        backend = CpuBackend()
        logger.info(
            "attention backend: cpu (%s)",
            "native kernels" if backend.is_native else "pure torch: no native kernels",
        )
        return backend
    else:
        backend = ReferenceBackend()
    logger.info("attention backend: %s", backend.name)
    return backend
