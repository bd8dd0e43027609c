"""The engine with a remote KV tier in a real valkey-server: a document's prefix comes back
from the store bit-exact, to this engine or a fresh one; the store's failures (killed,
down at start-up, garbage under real keys) cost hits, never answers; tenants stay apart."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvstore.tier import TierMetrics
from ragserve import LLM, SamplingParams
from ragserve.outputs import RequestOutput
from tests.model_factory import make_tiny_model
from tests.valkey_server import ValkeyServer, free_port

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 16
QUESTION = [42, 43]
ROUNDS = 100  # bounded retries while a restarted store comes back


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", max_position_embeddings=256)


@pytest.fixture(scope="module")
def doc() -> list[int]:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(3, 128, (150,), generator=generator).tolist()


@pytest.fixture(scope="module")
def full_tokens(doc: list[int]) -> int:
    """Prompt tokens of ``doc + QUESTION`` in full blocks a hit can cover (all of doc's)."""
    return len(doc) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def reference(model_dir: Path, doc: list[int]) -> list[int]:
    with LLM(str(model_dir), device="cpu", dtype="float32", enable_prefix_caching=False) as llm:
        return answer(llm, doc).outputs[0].token_ids


def engine(model_dir: Path, url: str, **options: Any) -> LLM:
    return LLM(
        str(model_dir),
        device="cpu",
        dtype="float32",
        kv_remote_url=url,
        **{"kv_remote_retry_s": 0.05, **options},
    )


@pytest.fixture
def open_engines() -> Iterator[list[LLM]]:
    engines: list[LLM] = []
    yield engines
    for llm in engines:
        llm.close()


def answer(llm: LLM, doc: list[int], namespace: str = "") -> RequestOutput:
    return llm.generate([doc + QUESTION], GREEDY, use_tqdm=False, namespace=namespace)[0]


def from_store(out: RequestOutput) -> int:
    return out.cached_tokens_by_tier.get("remote", 0)


def ingest(llm: LLM, doc: list[int], namespace: str = "") -> None:
    """Compute the document as the document API does: its blocks written through."""
    llm.engine.add_request("ingest", doc, SamplingParams(max_tokens=1), namespace, persist=True)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.engine.tiers is not None
    llm.engine.tiers.flush()


def remote(llm: LLM) -> TierMetrics:
    return llm.snapshot().tier_metrics["remote"]


def test_a_fresh_engine_answers_from_the_store_with_identical_outputs(
    model_dir: Path,
    doc: list[int],
    full_tokens: int,
    reference: list[int],
    valkey: ValkeyServer,
    open_engines: list[LLM],
) -> None:
    first = engine(model_dir, valkey.url, kv_cpu_gib=0.01)
    open_engines.append(first)
    ingest(first, doc)
    assert valkey.client().dbsize() == full_tokens // BLOCK
    assert first.engine.info.remote_tier_url == valkey.url

    second = engine(model_dir, valkey.url, kv_cpu_gib=0.01)  # empty device and CPU tiers
    open_engines.append(second)
    out = answer(second, doc)
    assert out.outputs[0].token_ids == reference
    assert out.num_cached_tokens >= full_tokens and from_store(out) >= full_tokens
    assert remote(second).hits == full_tokens // BLOCK
    second.engine.block_pool.check_invariants()

    # The first engine's own device copy, evicted, comes back from the store too (its CPU
    # tier has it as well and is read first).
    assert first.reset_prefix_cache() > 0
    again = answer(first, doc)
    assert again.outputs[0].token_ids == reference
    assert again.cached_tokens_by_tier.get("cpu", 0) >= full_tokens


def test_kill_9_of_the_store_mid_run_then_hits_resume(
    model_dir: Path,
    doc: list[int],
    full_tokens: int,
    reference: list[int],
    valkey: ValkeyServer,
    open_engines: list[LLM],
) -> None:
    llm = engine(model_dir, valkey.url)
    open_engines.append(llm)
    ingest(llm, doc)
    llm.reset_prefix_cache()  # the device forgets: the store is the only copy
    prompts = [doc + QUESTION, doc + [44, 45], list(range(3, 60))]
    for number, prompt in enumerate(prompts):
        llm.engine.add_request(f"r{number}", prompt, GREEDY)
    valkey.kill()
    outputs: dict[str, RequestOutput] = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                outputs[out.request_id] = out
    assert sorted(outputs) == ["r0", "r1", "r2"]
    assert all(len(out.outputs[0].token_ids) == GREEDY.max_tokens for out in outputs.values())
    assert outputs["r0"].outputs[0].token_ids == reference  # recomputed
    assert from_store(outputs["r0"]) == 0
    down = remote(llm)
    assert down.errors >= 1 and down.breaker_openings == 1

    valkey.start()  # same port, empty
    for _ in range(ROUNDS):
        llm.reset_prefix_cache()  # demotes the document's blocks: offered to the store
        assert llm.engine.tiers is not None
        llm.engine.tiers.flush()
        out = answer(llm, doc)
        assert out.outputs[0].token_ids == reference
        if from_store(out) >= full_tokens:
            break
    else:
        pytest.fail("no hits from the store after it came back")
    assert not remote(llm).breaker_open


def test_a_hung_store_costs_time_outs_not_answers(
    model_dir: Path,
    doc: list[int],
    reference: list[int],
    valkey: ValkeyServer,
    open_engines: list[LLM],
) -> None:
    llm = engine(model_dir, valkey.url, kv_remote_timeout_s=0.2, kv_remote_retry_s=60.0)
    open_engines.append(llm)
    ingest(llm, doc)
    llm.reset_prefix_cache()
    assert valkey.process is not None
    valkey.process.send_signal(signal.SIGSTOP)  # connections stay open; nothing answers
    try:
        out = answer(llm, doc)
        assert out.outputs[0].token_ids == reference and from_store(out) == 0
        stats = remote(llm)
        assert stats.errors >= 1 and stats.breaker_openings <= 1 and stats.hits == 0
        # Once the breaker is open, the store is not called at all: no more time-outs.
        for length in range(40, 50):  # new prompts: each asks the store about its blocks
            if remote(llm).breaker_open:
                break
            answer(llm, list(range(3, length)))
        assert remote(llm).breaker_open
        errors = remote(llm).errors
        assert answer(llm, doc).outputs[0].token_ids == reference
        assert remote(llm).errors == errors
    finally:
        valkey.process.send_signal(signal.SIGCONT)


def test_garbage_under_real_keys_is_a_miss_and_deleted(
    model_dir: Path,
    doc: list[int],
    reference: list[int],
    valkey: ValkeyServer,
    open_engines: list[LLM],
) -> None:
    first = engine(model_dir, valkey.url)
    open_engines.append(first)
    ingest(first, doc)
    client = valkey.client()
    keys = list(client.keys("ragserve:kv:*"))
    assert keys
    for number, key in enumerate(keys):
        client.set(key, b"garbage" * (number + 1))

    second = engine(model_dir, valkey.url)
    open_engines.append(second)
    out = answer(second, doc)
    assert out.outputs[0].token_ids == reference
    assert from_store(out) == 0
    stats = remote(second)
    assert stats.hits == 0 and stats.corrupt_records == len(keys)
    assert client.exists(*keys) == 0


def test_two_tenants_never_hit_each_others_values(
    model_dir: Path,
    doc: list[int],
    full_tokens: int,
    reference: list[int],
    valkey: ValkeyServer,
    open_engines: list[LLM],
) -> None:
    first = engine(model_dir, valkey.url)
    open_engines.append(first)
    ingest(first, doc, namespace="alice")
    second = engine(model_dir, valkey.url)
    open_engines.append(second)
    bob = answer(second, doc, namespace="bob")
    assert bob.outputs[0].token_ids == reference
    assert bob.num_cached_tokens == 0 and remote(second).hits == 0
    alice = answer(second, doc, namespace="alice")
    assert alice.outputs[0].token_ids == reference
    assert from_store(alice) >= full_tokens


def test_a_store_down_at_start_up_does_not_stop_the_engine(
    model_dir: Path, doc: list[int], reference: list[int], open_engines: list[LLM]
) -> None:
    llm = engine(model_dir, f"redis://127.0.0.1:{free_port()}/0", kv_remote_retry_s=60.0)
    open_engines.append(llm)
    out = answer(llm, doc)
    assert out.outputs[0].token_ids == reference and out.num_cached_tokens == 0
    stats = remote(llm)
    assert stats.errors >= 1 and stats.breaker_openings <= 1 and stats.hits == 0


def test_a_bad_url_is_a_clear_error(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="KV remote URL cannot be used"):
        LLM(str(model_dir), device="cpu", dtype="float32", kv_remote_url="http://x:1/0")


def test_remote_tier_options_are_checked_with_the_config() -> None:
    from ragserve.config import EngineConfig

    url = "redis://127.0.0.1:6379/0"
    with pytest.raises(ValueError, match="need prefix caching"):
        EngineConfig(kv_remote_url=url, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_remote_timeout_s must be > 0"):
        EngineConfig(kv_remote_url=url, kv_remote_timeout_s=0)
    # A key file with a remote tier encrypts the remote tier; it asks for no disk tier.
    assert EngineConfig(kv_remote_url=url, kv_encryption_key_file="k").disk_tier_gib == 0
    assert EngineConfig(kv_encryption_key_file="k").disk_tier_gib > 0


def test_a_purged_document_leaves_the_store_with_what_follows_it(
    model_dir: Path, doc: list[int], full_tokens: int, valkey: ValkeyServer, open_engines: list[LLM]
) -> None:
    llm = engine(model_dir, valkey.url)
    open_engines.append(llm)
    ingest(llm, doc)
    question = doc + list(range(3, 3 + 2 * BLOCK))  # two more full blocks after the document
    answer(llm, question)
    llm.reset_prefix_cache()  # the question's blocks are demoted: written to the store too
    assert llm.engine.tiers is not None
    llm.engine.tiers.flush()
    client = valkey.client()
    assert client.dbsize() == full_tokens // BLOCK + 2
    other = list(range(3, 3 + 3 * BLOCK))  # another prompt's blocks stay
    ingest(llm, other)
    assert llm.engine.locate_prefix(doc)["remote"] == full_tokens // BLOCK
    removed = llm.engine.purge_prefix(doc)
    assert removed["remote"] == full_tokens // BLOCK + 2
    assert client.dbsize() == 3
    assert llm.engine.locate_prefix(doc)["remote"] == 0


def test_a_document_pinned_from_the_store_is_kept_on_this_engines_disk(
    model_dir: Path,
    doc: list[int],
    full_tokens: int,
    reference: list[int],
    valkey: ValkeyServer,
    open_engines: list[LLM],
    tmp_path: Path,
) -> None:
    """A pinned document persists on its engine's own disk even when its blocks came from
    the store, which may evict them or restart empty."""
    first = engine(model_dir, valkey.url, kv_cpu_gib=0.01)
    open_engines.append(first)
    ingest(first, doc)
    disk = {"kv_disk_dir": str(tmp_path / "kv"), "kv_disk_gib": 0.05}
    with engine(model_dir, valkey.url, kv_cpu_gib=0.01, **disk) as second:
        ingest(second, doc)  # as the document API does on this replica: found in the store
        assert remote(second).hits == full_tokens // BLOCK
        assert second.engine.pin_prefix("doc", doc) == full_tokens
    valkey.client().flushall()
    with engine(model_dir, valkey.url, kv_cpu_gib=0.01, **disk) as restarted:
        out = answer(restarted, doc)
    assert out.outputs[0].token_ids == reference
    assert out.cached_tokens_by_tier.get("disk", 0) >= full_tokens
