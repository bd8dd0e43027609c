"""The KV pool's size: a given budget, the CPU's default, and a GPU engine's own share of
its card (``gpu_memory_utilization``), whatever other engines on the card hold."""

from __future__ import annotations

import torch

from ragserve.config import EngineConfig
from ragserve.engine.engine_setup import gpu_kv_budget, kv_budget_bytes

GIB = 2**30
CARD = 80 * GIB
RESERVE = 1 * GIB


def test_two_engines_at_045_share_one_card() -> None:
    """The first takes its share; the second, started beside it, still gets its own."""
    weights = 2 * GIB
    first = gpu_kv_budget(CARD - weights, CARD, weights, 0.45, RESERVE)
    assert first == 0.45 * CARD - weights - RESERVE
    free = CARD - weights - first - RESERVE - weights  # the first engine's memory is taken
    second = gpu_kv_budget(free, CARD, weights, 0.45, RESERVE)
    assert second == first


def test_an_engine_never_takes_more_than_is_free() -> None:
    assert gpu_kv_budget(10 * GIB, CARD, 0, 0.9, RESERVE) == 9 * GIB
    assert gpu_kv_budget(0.5 * GIB, CARD, 0, 0.9, RESERVE) == 0.0


def test_the_share_counts_this_engines_own_weights() -> None:
    assert gpu_kv_budget(CARD, CARD, 70 * GIB, 0.9, RESERVE) == 0.9 * CARD - 71 * GIB
    assert gpu_kv_budget(CARD, CARD, 75 * GIB, 0.9, RESERVE) == 0.0


def test_a_given_budget_and_the_cpus_default() -> None:
    cpu = torch.device("cpu")
    given = EngineConfig(kv_cache_gib=0.5)
    assert kv_budget_bytes(given, cpu, bytes_per_token=1000, max_model_len=100) == 0.5 * GIB
    few = EngineConfig(max_num_seqs=4)
    assert kv_budget_bytes(few, cpu, bytes_per_token=1000, max_model_len=100) == 4 * 100 * 1000
    many = EngineConfig(max_num_seqs=256)
    assert kv_budget_bytes(many, cpu, bytes_per_token=10**6, max_model_len=8192) == 4 * GIB
