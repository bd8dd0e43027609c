"""How big the engine's KV pool is and which tiers sit below it, from the config."""

from __future__ import annotations

import gc
import logging

import torch

from kvstore.block_pool import BlockPool
from kvstore.record_cipher import RecordCipher
from kvstore.tier_stack import TierStack
from ragserve.config import EngineConfig

logger = logging.getLogger(__name__)


def kv_budget_bytes(
    config: EngineConfig, device: torch.device, bytes_per_token: int, max_model_len: int
) -> float:
    """Bytes for the device KV pool: ``kv_cache_gib`` when given; otherwise on a GPU this
    engine's share of it (:func:`gpu_kv_budget`), or on the CPU enough for every sequence
    at full length, at most 4 GiB."""
    if config.kv_cache_gib is not None:
        return config.kv_cache_gib * 2**30
    if device.type == "cuda":
        # NOTE: an engine dropped without close() may still hold memory until the
        # collector runs; count only what is really in use.
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        # Leave room for activations of the largest step and the allocator's slack.
        reserve = 2**30 + config.step_tokens * 64 * 1024
        own = torch.cuda.memory_reserved(device)
        share = config.gpu_memory_utilization * total - own
        if free < share:
            logger.warning(
                "the GPU has %.1f GiB free, less than this engine's share "
                "(gpu_memory_utilization %g): the KV pool takes what is free",
                free / 2**30, config.gpu_memory_utilization,
            )  # fmt: skip
        return gpu_kv_budget(free, total, own, config.gpu_memory_utilization, reserve)
    wanted = config.max_num_seqs * max_model_len * bytes_per_token
    return float(min(wanted, 4 * 2**30))


def gpu_kv_budget(
    free: float, total: float, own: float, utilization: float, reserve: float
) -> float:
    """KV bytes for an engine that may use ``utilization`` of a card of ``total`` bytes, of
    which its process holds ``own`` already (the weights) and ``free`` are free, less
    ``reserve`` for activations.

    The share is this engine's alone, as users of other engines expect: two engines at 0.45
    share one card, where counting every process's memory against each engine's share left
    the second none. It never takes more than is free."""
    return max(0.0, min(utilization * total - own, free) - reserve)


def open_tiers(config: EngineConfig, kv_cache: torch.Tensor, pool: BlockPool) -> TierStack | None:
    """The tier stack below the device pool, or None when no tier is configured; a bad key
    file, disk directory or remote URL is a ValueError naming it (a remote store that is
    down is not: its lookups miss until it answers)."""
    disk_gib = config.disk_tier_gib
    if not config.enable_prefix_caching or (
        config.kv_cpu_gib <= 0 and disk_gib <= 0 and not config.kv_remote_url
    ):
        return None
    if config.kv_disk_gib is None and disk_gib > 0:
        logger.info(
            "disk KV tier on in %s with the default budget of %g GiB (--kv-disk-gib sets it)",
            config.kv_disk_dir or "the default folder", disk_gib,
        )  # fmt: skip
    if config.kv_remote_url:
        # NOTE: imported here: the store's client costs about 0.3 s of start-up, paid
        # only by engines that have a remote tier.
        from kvstore.remote_store import check_store_url

        try:
            check_store_url(config.kv_remote_url)
        except ValueError as exc:
            raise ValueError(f"the KV remote URL cannot be used: {exc}") from exc
    cipher = None
    if config.kv_encryption_key_file:
        try:
            cipher = RecordCipher.from_file(config.kv_encryption_key_file)
        except (OSError, ValueError) as exc:
            raise ValueError(f"the KV encryption key cannot be used: {exc}") from exc
    try:
        return TierStack.from_budgets(
            kv_cache,
            pool,
            cpu_gib=config.kv_cpu_gib,
            disk_gib=disk_gib,
            disk_dir=config.kv_disk_dir,
            cipher=cipher,
            remote_url=config.kv_remote_url,
            remote_timeout_s=config.kv_remote_timeout_s,
            remote_retry_s=config.kv_remote_retry_s,
        )
    except OSError as exc:
        raise ValueError(f"the KV disk directory cannot be used: {exc}") from exc
