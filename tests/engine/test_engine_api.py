"""The offline API on the embedded model: sampling options, stops, errors, no leaks."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from ragserve import LLM, SamplingParams
from ragserve.config import EngineConfig
from ragserve.engine.async_engine import AsyncEngine
from ragserve.outputs import CompletionOutput


@pytest.fixture(scope="module")
def llm(smollm_path: str) -> LLM:
    return LLM(smollm_path, max_model_len=512)


def assert_no_leak(llm: LLM) -> None:
    llm.engine.block_pool.check_invariants()
    assert llm.engine.block_pool.num_used == 0


@pytest.mark.slow
def test_chat_answers_with_the_template(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=20),
        use_tqdm=False,
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # <|im_end|> ends the turn
    assert out.prompt_token_ids[0] == llm.get_tokenizer().convert_tokens_to_ids("<|im_start|>")
    assert_no_leak(llm)


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_and_seed_dependent(llm: LLM) -> None:
    prompt = "Write a short poem about the sea."

    def run(seed: int) -> str:
        params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=seed, max_tokens=24)
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text

    first, again, other = run(1), run(1), run(2)
    assert first == again
    assert first != other
    # A seeded request gives the same text whatever runs beside it in the batch.
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=1, max_tokens=24)
    batched = llm.generate(
        [prompt, "Other prompt", prompt * 2],
        [params, SamplingParams(temperature=1.0), params],
        use_tqdm=False,
    )
    assert batched[0].outputs[0].text == first
    assert_no_leak(llm)


@pytest.mark.slow
def test_stop_strings_are_cut_from_the_text(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = llm.generate("Count: 1, 2, 3,", greedy, use_tqdm=False)[0].outputs[0].text
    assert " 5" in full, full
    stop_at = full.index(" 5")
    stopped = llm.generate(
        "Count: 1, 2, 3,",
        SamplingParams(temperature=0.0, max_tokens=30, stop=[" 5"]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.text == full[:stop_at]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == " 5"


@pytest.mark.slow
def test_the_earliest_stop_string_cuts_and_none_does_before_min_tokens(llm: LLM) -> None:
    prompt = "Count: 1, 2, 3,"
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].text
    stop_at = full.index(" 5")

    def run(**options: Any) -> CompletionOutput:
        params = SamplingParams(
            **{"temperature": 0.0, "max_tokens": 30, "ignore_eos": True, **options}
        )
        return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]

    # Both stops complete in one step; the one that starts first cuts, whatever the order.
    for stops in (["5", " 5"], [" 5", "5"]):
        out = run(stop=stops)
        assert (out.text, out.stop_reason) == (full[:stop_at], " 5"), stops
    # Before min_tokens a stop string is text; the first one after it stops.
    late = run(stop=[","], min_tokens=20)
    assert len(late.token_ids) >= 20 and late.finish_reason == "stop"
    assert full.startswith(late.text) and late.text.count(",") >= 5
    assert run(stop=[",", "a much longer stop"], min_tokens=20).text == late.text
    assert run(stop=[" 5"], min_tokens=30).text == full
    # A temperature too small to divide by is greedy.
    assert run(temperature=1e-38).text == full
    assert_no_leak(llm)


@pytest.mark.slow
def test_stop_token_ids_min_tokens_and_max_tokens(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = llm.generate("The alphabet: a b c", greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_token = tokens[3]
    first = tokens.index(stop_token)
    out = llm.generate(
        "The alphabet: a b c",
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_token]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.token_ids == tokens[: first + 1] and out.stop_reason == stop_token
    # The stop token's text is left out, as OpenAI and vLLM leave it out.
    assert out.text == llm.get_tokenizer().decode(tokens[:first])
    eos_early = llm.chat(
        [{"role": "user", "content": "Say OK."}],
        SamplingParams(temperature=0.0, max_tokens=40),
        use_tqdm=False,
    )[0].outputs[0]
    assert eos_early.finish_reason == "stop"
    at_least = llm.chat(
        [{"role": "user", "content": "Say OK."}],
        SamplingParams(temperature=0.0, max_tokens=40, min_tokens=len(eos_early.token_ids) + 3),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(at_least.token_ids) >= len(eos_early.token_ids) + 3
    assert (
        len(
            llm.generate("x", SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )
        == 5
    )


@pytest.mark.slow
def test_logprobs_and_n_samples_share_the_prompt(llm: LLM) -> None:
    params = SamplingParams(temperature=0.8, seed=3, n=3, max_tokens=8, logprobs=2)
    doc = "A document that all three samples read. " * 10
    before = llm.engine.stats.prompt_tokens_computed
    out = llm.generate(doc, params, use_tqdm=False)[0]
    computed = llm.engine.stats.prompt_tokens_computed - before
    prompt_len = len(out.prompt_token_ids)
    assert len(out.outputs) == 3
    assert computed < prompt_len + 2 * 16 + 2, "the shared prompt was prefilled more than once"
    for sample in out.outputs:
        assert sample.logprobs is not None and len(sample.logprobs) == len(sample.token_ids)
        for token, step in zip(sample.token_ids, sample.logprobs, strict=True):
            assert token in step and step[token].logprob <= 0.0
            assert len(step) in (2, 3)
    assert_no_leak(llm)


@pytest.mark.slow
def test_token_id_prompts_and_vllm_prompt_dicts(llm: LLM) -> None:
    ids = llm.get_tokenizer().encode("Hello there")
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    a = llm.generate(ids, greedy, use_tqdm=False)[0]
    b = llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)[0]
    c = llm.generate("Hello there", greedy, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    assert c.prompt == "Hello there" and c.prompt_token_ids == list(ids)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n must be"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": 50}, "logprobs"),
    ],
)
def test_invalid_sampling_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_bad_prompts_are_clear_errors_and_leave_nothing_behind(llm: LLM) -> None:
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match=r"600 tokens but max_model_len is 512"):
        llm.generate([[5] * 600], use_tqdm=False)
    for ids in ([1, 10**9], [1, -3], [1, 2**64]):  # 2**64 overflows any machine integer
        with pytest.raises(ValueError, match=rf"\[{ids[1]}\] are outside the vocabulary"):
            llm.generate([ids], use_tqdm=False)
    with pytest.raises(ValueError, match="integers only"):
        llm.generate([[1, 2.5]], use_tqdm=False)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    # A good prompt before a bad one is not left queued.
    with pytest.raises(ValueError, match=r"^prompt 1: .*empty"):
        llm.generate(["fine", ""], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert_no_leak(llm)


@pytest.mark.slow
def test_a_request_that_can_never_fit_is_refused(smollm_path: str) -> None:
    small = LLM(smollm_path, kv_cache_gib=4 * 16 * 46080 / 2**30)  # 4 blocks = 64 tokens
    with pytest.raises(ValueError, match=r"needs 5 KV blocks \(80 tokens\) but the cache holds 4"):
        small.generate([[7] * 70], SamplingParams(max_tokens=10), use_tqdm=False)
    with pytest.raises(ValueError, match=r"needs 5 KV blocks \(65 tokens\)"):
        small.generate([[7] * 64], SamplingParams(max_tokens=None), use_tqdm=False)  # no room
    # Without max_tokens a request runs up to what the cache holds, not the whole context.
    unbounded = SamplingParams(max_tokens=None, ignore_eos=True)
    out = small.generate([[7] * 50], unbounded, use_tqdm=False)[0]
    assert (len(out.outputs[0].token_ids), out.outputs[0].finish_reason) == (14, "length")
    assert_no_leak(small)
    # ... and beside pinned documents, up to what they leave it.
    document = [9] * 16
    small.generate([document], SamplingParams(max_tokens=1), use_tqdm=False)
    assert small.engine.pin_prefix("doc", document) == 16
    out = small.generate([[7] * 10], unbounded, use_tqdm=False)[0]
    assert out.error is None and out.outputs[0].finish_reason == "length"
    assert 10 + len(out.outputs[0].token_ids) >= 3 * 16 - 1
    assert small.engine.unpin_prefix("doc")
    assert_no_leak(small)


def test_unknown_model_path_and_engine_arguments(tmp_path: object) -> None:
    with pytest.raises(ValueError, match="does-not-exist"):
        LLM("/no/such/dir/does-not-exist")
    with pytest.raises(ValueError, match="block_size"):
        LLM(None, block_size=12)
    with pytest.raises(ValueError, match="unknown engine argument: not_an_option"):
        LLM(None, not_an_option=1)
    with pytest.raises(ValueError, match="wrong type"):
        LLM(None, max_model_len="1024")


def test_sampling_params_of_another_type_are_refused_and_nothing_stays_queued(
    llm: LLM,
) -> None:
    for bad in ([SamplingParams(max_tokens=1), "x"], 5):
        with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
            llm.generate(["a", "b"], bad, use_tqdm=False)  # type: ignore[arg-type]
    assert not llm.engine.has_unfinished_requests()


def test_pinned_documents_never_starve_requests(smollm_path: str) -> None:
    """Pins hold at most half the KV blocks; a request they still block fails alone, clearly."""
    block_bytes = 16 * 46080
    llm = LLM(smollm_path, kv_cache_gib=10 * block_bytes / 2**30)  # 10 blocks of 16 tokens
    engine = llm.engine
    first, second = [11] * 64 + [12], [13] * 48 + [14]  # 4 and 3 full blocks
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([first, second], greedy, use_tqdm=False)
    assert engine.pin_prefix("doc-1", first) == 64
    assert engine.pin_prefix("doc-2", second) == 0, "4 + 3 pinned blocks exceed half of 10"
    assert engine.kv_usage()["pinned"] == 4
    blocked = llm.generate([[15] * 100], SamplingParams(max_tokens=8), use_tqdm=False)[0]
    assert blocked.finished and "pinned documents hold 4 of 10 blocks" in (blocked.error or "")
    ok = llm.generate([[16] * 40], SamplingParams(max_tokens=8), use_tqdm=False)[0]
    assert len(ok.outputs[0].token_ids) >= 1
    assert engine.unpin_prefix("doc-1")
    engine.block_pool.check_invariants()
    assert engine.block_pool.num_used == 0


def run_all(engine: Any) -> dict[str, Any]:
    """Step until every request is done; the finished outputs by request id."""
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    return finished


def test_a_request_that_fits_is_not_failed_for_another_tenants_that_does_not(
    smollm_path: str,
) -> None:
    """Tenant a asks about its pinned document (served last, so b is first in turn); b's
    request fits an empty cache but not beside the pin: b's alone fails."""
    block_bytes = 16 * 46080
    llm = LLM(smollm_path, kv_cache_gib=10 * block_bytes / 2**30, max_num_batched_tokens=64)
    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    document = [21] * 64 + [22]  # 4 full blocks
    engine.add_request("ingest", document, SamplingParams(max_tokens=1), namespace="a")
    engine.add_request("earlier", [26] * 48, SamplingParams(max_tokens=1), namespace="a")
    run_all(engine)
    assert engine.pin_prefix("doc", document, namespace="a") == 64  # 6 of 10 blocks left
    engine.add_request("question", [*document, 23, 24], greedy, namespace="a")
    engine.add_request("too-big", [25] * 100, greedy, namespace="b")  # 7 blocks with its answer
    done = run_all(engine)
    assert done["question"].error is None and len(done["question"].outputs[0].token_ids) == 8
    assert "pinned documents hold 4 of 10 blocks" in str(done["too-big"].error)
    assert engine.unpin_prefix("doc")
    assert_no_leak(llm)


def test_samples_without_max_tokens_each_end_at_the_room_pins_leave(smollm_path: str) -> None:
    block_bytes = 16 * 46080
    llm = LLM(smollm_path, kv_cache_gib=12 * block_bytes / 2**30, max_num_batched_tokens=64)
    document = [41] * 80 + [42]  # 5 full blocks: 7 of 12 left
    llm.generate([document], SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.engine.pin_prefix("doc", document) == 80
    unbounded = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True, n=2)
    out = llm.generate([[43] * 40], unbounded, use_tqdm=False)[0]
    assert out.error is None
    assert [c.finish_reason for c in out.outputs] == ["length", "length"]
    assert all(len(c.token_ids) > 0 for c in out.outputs)
    assert llm.engine.unpin_prefix("doc")
    assert_no_leak(llm)


def test_a_prefix_in_a_tier_that_pins_leave_no_room_to_load_fails_and_never_hangs(
    smollm_path: str,
) -> None:
    """Its blocks are in the CPU tier, but pins leave fewer device blocks than it needs:
    waiting to load the rest would wait for good, so it fails as it would without a tier."""
    block_bytes = 16 * 46080
    llm = LLM(
        smollm_path, kv_cache_gib=10 * block_bytes / 2**30, kv_cpu_gib=20 * block_bytes / 2**30
    )
    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    document, pinned = [31] * 112 + [32], [33] * 64 + [34]  # 7 and 4 full blocks
    llm.generate([document], greedy, use_tqdm=False)
    llm.reset_prefix_cache()  # its blocks go down to the CPU tier
    llm.generate([pinned], greedy, use_tqdm=False)
    assert engine.pin_prefix("doc", pinned) == 64  # 6 of 10 blocks left for 8
    engine.add_request("again", document, greedy)
    outputs = []
    for _ in range(50):
        outputs += engine.step()
        if not engine.has_unfinished_requests():
            break
    assert [o.request_id for o in outputs if o.finished] == ["again"]
    assert "pinned documents hold 4 of 10 blocks" in str(outputs[-1].error)
    assert engine.unpin_prefix("doc")
    engine.block_pool.check_invariants()
    assert engine.block_pool.num_used == 0


def test_each_namespace_pins_within_its_share(smollm_path: str) -> None:
    """With a namespace share, one tenant's pins cannot take the pin budget from another."""
    block_bytes = 16 * 46080
    llm = LLM(smollm_path, kv_cache_gib=20 * block_bytes / 2**30)  # 20 blocks: 10 may be pinned
    engine = llm.engine
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    a1, a2, b1 = [21] * 64 + [22], [23] * 48 + [24], [25] * 48 + [26]  # 4, 3 and 3 blocks
    llm.generate([a1, a2], greedy, use_tqdm=False, namespace="a")
    llm.generate([b1], greedy, use_tqdm=False, namespace="b")
    assert engine.pin_prefix("a1", a1, "a", namespace_share=0.5) == 64
    assert engine.pin_prefix("a2", a2, "a", namespace_share=0.5) == 0, "4 + 3 exceed 5 of a's"
    assert engine.pin_prefix("b1", b1, "b", namespace_share=0.5) == 48
    assert engine.kv_usage()["pinned"] == 7
    with pytest.raises(ValueError, match="namespace_share"):
        engine.pin_prefix("bad", b1, "b", namespace_share=1.5)
    assert engine.unpin_prefix("a1") and engine.unpin_prefix("b1")
    assert engine.pin_prefix("a2", a2, "a", namespace_share=0.5) == 48
    assert engine.unpin_prefix("a2")
    engine.block_pool.check_invariants()
    assert engine.block_pool.num_used == 0


def test_each_engine_prepares_the_thread_that_steps_it(llm: LLM, smollm_path: str) -> None:
    """Per-thread GPU state (PyTorch caches cuDNN's plans per thread) is built where the
    steps run: the constructing thread for ``LLM``, the engine thread for ``AsyncEngine``."""
    assert llm.engine.prepared_threads == {threading.get_ident()}

    async def serve_one() -> set[int]:
        engine = AsyncEngine(EngineConfig(model=smollm_path, max_model_len=256))
        try:
            params = SamplingParams(temperature=0.0, max_tokens=2)
            outputs = [out async for out in engine.generate("Hello", params)]
            assert outputs[-1].finished
            return set(engine.engine.prepared_threads)
        finally:
            await engine.shutdown()

    prepared = asyncio.run(serve_one())
    assert len(prepared) == 1 and threading.get_ident() not in prepared
