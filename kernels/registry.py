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


def get_backend(name: str | None, device: torch.device, fp8_kv: bool = False) -> AttentionBackend:
    """The named backend, or the best one available on ``device`` when ``name`` is None.

    ``fp8_kv``: the cache is FP8 (``kernels/fp8_kv.py``). Unnamed, the backend is then the
    reference one, the only reader of FP8 so far; a named one that cannot read it is a
    ValueError (from ``check_kv_cache`` at start-up)."""
    choices = available_backends(device)
    chosen = name or choices[0]
    if fp8_kv and name is None and chosen != "reference":
        # NOTE: the native CPU and Triton kernels read only plain caches so far.
        log = logger.warning if device.type == "cuda" else logger.info
        log(
            "attention backend: reference, not %s: an FP8 KV cache is read only by the "
            "reference backend so far (it dequantizes the blocks each step reads)",
            chosen,
        )
        chosen = "reference"
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
