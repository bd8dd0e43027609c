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


# Backends whose kernels read an 8-bit KV cache of either kind (``kernels/fp8_kv.py``).
QUANTIZED_KV_BACKENDS = ("triton", "reference")


def choose_backend_name(
    name: str | None, device_type: str, choices: list[str], quantized_kv: bool = False
) -> str:
    """The backend ``get_backend`` builds: ``name``, or else the first of ``choices`` (the
    device's available backends, best first) that can read the cache.

    With an 8-bit cache (fp8 or int8) that is Triton on CUDA and the reference backend on
    the CPU (the native CPU kernels read plain caches only). A named backend is kept as
    named: one that cannot read the cache refuses it at start-up (``check_kv_cache``)."""
    chosen = name or choices[0]
    if quantized_kv and name is None and chosen not in QUANTIZED_KV_BACKENDS:
        fallback = next(c for c in choices if c in QUANTIZED_KV_BACKENDS)
        log = logger.warning if device_type == "cuda" else logger.info
        log(
            "attention backend: %s, not %s: the %s kernels read plain KV caches only",
            fallback,
            chosen,
            chosen,
        )
        chosen = fallback
    return chosen


def get_backend(
    name: str | None, device: torch.device, quantized_kv: bool = False
) -> AttentionBackend:
    """The named backend, or the best one available on ``device`` when ``name`` is None.

    ``quantized_kv``: the cache is 8-bit, fp8 or int8 (``kernels/fp8_kv.py``): see
    ``choose_backend_name``."""
    choices = available_backends(device)
    chosen = choose_backend_name(name, device.type, choices, quantized_kv)
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
