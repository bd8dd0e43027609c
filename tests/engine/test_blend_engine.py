"""Blended reuse of document KV in the engine (float32, CPU, tiny random model)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore.segments import make_segment, segment_stored
from ragserve import LLM, SamplingParams
from tests.engine.blend_rig import DOCS, GREEDY, TEMPLATE, Driver, prompt, tokens_of
from tests.model_factory import make_tiny_model

BLOCK = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = make_tiny_model(tmp_path_factory.mktemp("blend"), "llama", max_position_embeddings=256)
    yield str(path)
    torch.set_num_threads(threads)


def engine(model_dir: str, **args: object) -> Driver:
    return Driver(
        LLM(
            model_dir,
            device="cpu",
            dtype="float32",
            block_size=BLOCK,
            max_num_batched_tokens=32,
            **args,  # type: ignore[arg-type]
        )
    )


def test_full_recompute_equals_full_prefill(model_dir: str) -> None:
    blend, full = (
        engine(model_dir, kv_reuse="blend"),
        engine(model_dir, enable_prefix_caching=False),
    )
    blend.run(prompt("abc"))  # computes the segments of b and c next to it
    blend.run(prompt("bac"))  # and of a
    assert blend.run(prompt("cab"), recompute_ratio=0.0).num_blended_tokens > 0
    for order, question in (("abc", 1), ("cab", 1), ("bca", 2), ("cba", 0)):
        got = blend.run(prompt(order, question), recompute_ratio=1.0)
        assert tokens_of(got) == tokens_of(full.run(prompt(order, question)))
        assert got.num_blended_tokens == 0
    blend.engine.block_pool.check_invariants()
    assert blend.engine.block_pool.num_used == 0


def test_blend_over_an_fp8_cache(model_dir: str) -> None:
    """Rotated FP8 segments are installed and read; full recompute equals a full prefill
    over the same FP8 cache."""
    blend, full = (
        engine(model_dir, kv_reuse="blend", kv_cache_dtype="fp8"),
        engine(model_dir, enable_prefix_caching=False, kv_cache_dtype="fp8"),
    )
    blend.run(prompt("abc"))
    blend.run(prompt("bac"))
    assert blend.run(prompt("cab"), recompute_ratio=0.0).num_blended_tokens > 0
    got = blend.run(prompt("cba", 1), recompute_ratio=1.0)
    assert tokens_of(got) == tokens_of(full.run(prompt("cba", 1)))
    blend.engine.block_pool.check_invariants()
    assert blend.engine.block_pool.num_used == 0


def test_one_document_or_cached_order_equals_prefix_caching(model_dir: str) -> None:
    blend, prefix = (
        engine(model_dir, kv_reuse="blend", blend_recompute_ratio=0.0),
        engine(model_dir),
    )
    for p in (prompt("b"), prompt("b", 1), prompt("abc"), prompt("abc", 1), prompt("abc", 2)):
        got, expected = blend.run(p), prefix.run(p)
        assert tokens_of(got) == tokens_of(expected)
        assert got.num_cached_tokens == expected.num_cached_tokens
        assert got.num_blended_tokens == 0


def test_a_document_the_exact_prefix_reaches_into_is_completed_as_prefix_caching_would(
    model_dir: str,
) -> None:
    """A blended request caches exact KV up to its first install, inside a document's
    recomputed lead: asked again in that order, the rest of the document is computed, not
    installed, so the answer is prefix caching's, and from then on all of it is cached."""
    blend = engine(model_dir, kv_reuse="blend", blend_recompute_ratio=0.2)
    prefix = engine(model_dir)
    blend.run(prompt("bc"))  # b's and c's segments
    first = blend.run(prompt("abc"))
    assert first.num_blended_tokens > 0
    prefix.run(prompt("abc"))
    for question in (1, 2):
        got, expected = blend.run(prompt("abc", question)), prefix.run(prompt("abc", question))
        assert tokens_of(got) == tokens_of(expected)
        assert got.num_blended_tokens == 0
    assert got.num_cached_tokens == expected.num_cached_tokens


def test_blend_installs_rotated_segments_and_counts_them_apart(model_dir: str) -> None:
    blend, full = (
        engine(model_dir, kv_reuse="blend"),
        engine(model_dir, enable_prefix_caching=False),
    )
    blend.run(prompt("abc"))  # computes the segments of b and c next to it
    p = prompt("cab", 1)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine_ = blend.engine
    engine_.add_request("probe", p.token_ids, params, documents=p.documents, recompute_ratio=0.0)
    while not (seqs := engine_._requests["probe"].seqs)[0].num_output_tokens:
        engine_.step()
    seq = seqs[0]
    assert seq.blend is not None
    installed = [(i.start, i.end) for i in seq.blend.installs if i.installed]
    assert installed, "a and b should come from their segments"
    # Layer 0's K/V depend on the token and its position alone: the installed rows must
    # equal those of a full prefill of the same prompt, keys rotated to the new place.
    reference = full.engine
    reference.add_request("ref", p.token_ids, params)
    while not (ref := reference._requests["ref"].seqs[0]).num_output_tokens:
        reference.step()
    for start, end in installed:
        for pos in range(start, end):
            got = engine_.kv_cache[seq.kv.block_table[pos // BLOCK], 0, :, pos % BLOCK]
            want = reference.kv_cache[ref.kv.block_table[pos // BLOCK], 0, :, pos % BLOCK]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    while engine_.has_unfinished_requests():
        outputs = engine_.step()
    reference.abort_request("ref")
    (out,) = outputs
    assert out.num_blended_tokens == sum(end - start for start, end in installed)
    # Exact hits only: the template and the leading document, up to a block boundary.
    assert out.num_cached_tokens <= p.documents[1][0]
    prompt_len = len(p.token_ids)
    computed = prompt_len - out.num_cached_tokens - out.num_blended_tokens
    assert out.num_recomputed_tokens <= computed
    assert engine_.block_pool.num_used == 0


def test_tenants_never_reuse_each_others_segments(model_dir: str) -> None:
    blend = engine(model_dir, kv_reuse="blend", blend_recompute_ratio=0.0)
    salt_a, salt_b = blend.engine.salt_for("a"), blend.engine.salt_for("b")
    blend.run(prompt("abc"), namespace="a")
    manager = blend.engine.kv_manager
    for name in "bc":
        assert segment_stored(manager, make_segment(salt_a, TEMPLATE, DOCS[name], BLOCK))
        assert not segment_stored(manager, make_segment(salt_b, TEMPLATE, DOCS[name], BLOCK))
    before = blend.engine.stats.prompt_tokens_computed
    out = blend.run(prompt("cab"), namespace="b")
    computed = blend.engine.stats.prompt_tokens_computed - before
    # b finds none of a's segments: it computes the whole prompt, and its own segments of
    # a and b next to it (c leads: its segment is not needed).
    assert out.num_blended_tokens == 0 and out.num_cached_tokens == 0
    own = sum(len(TEMPLATE) + len(DOCS[name]) for name in "ab")
    shared = len(TEMPLATE) // BLOCK * BLOCK  # the template's full blocks: one segment's hit
    assert computed == len(prompt("cab").token_ids) + own - shared
    for name in "ab":
        assert segment_stored(manager, make_segment(salt_b, TEMPLATE, DOCS[name], BLOCK))
    assert blend.run(prompt("bca"), namespace="a").num_blended_tokens > 0
    assert blend.run(prompt("acb", 1), namespace="b").num_blended_tokens > 0


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_segments_from_every_tier_give_the_same_outputs(
    model_dir: str, tmp_path: Path, tier: str
) -> None:
    args = {
        "cpu": {"kv_cpu_gib": 0.001},
        "disk": {"kv_disk_dir": str(tmp_path), "kv_disk_gib": 0.01},
    }[tier]
    reference = engine(model_dir, kv_reuse="blend", blend_recompute_ratio=0.2)
    reference.run(prompt("abc"))
    on_device = reference.run(prompt("cab", 1))  # its segments on the device
    assert on_device.num_blended_tokens > 0
    first = engine(model_dir, kv_reuse="blend", blend_recompute_ratio=0.2, **args)
    first.run(prompt("abc"))
    first.engine.reset_prefix_cache()  # every cached block demoted to the tier
    assert first.engine.tiers is not None
    first.engine.tiers.flush()
    if tier == "disk":
        first.engine.shutdown()
        first = engine(model_dir, kv_reuse="blend", blend_recompute_ratio=0.2, **args)
    run = first.run(prompt("cab", 1))
    assert run.cached_tokens_by_tier[tier] == run.num_cached_tokens > 0
    assert tokens_of(run) == tokens_of(on_device)
    assert run.num_blended_tokens == on_device.num_blended_tokens
    assert run.num_cached_tokens == on_device.num_cached_tokens


def test_segments_whose_records_fail_verification_are_recomputed(
    model_dir: str, tmp_path: Path
) -> None:
    tiers = {"kv_disk_dir": str(tmp_path), "kv_disk_gib": 0.01}
    first = engine(model_dir, kv_reuse="blend", blend_recompute_ratio=0.2, **tiers)
    first.run(prompt("abc"))
    first.run(prompt("bca"))
    assert first.run(prompt("cab", 1)).num_blended_tokens > 0
    first.engine.reset_prefix_cache()
    first.engine.shutdown()
    records = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert records
    for record in records:  # flip a byte in the middle of every record
        data = bytearray(record.read_bytes())
        data[len(data) // 2] ^= 0xFF
        record.write_bytes(bytes(data))
    restarted = engine(model_dir, kv_reuse="blend", blend_recompute_ratio=0.2, **tiers)
    got = restarted.run(prompt("cab", 1))
    assert got.num_blended_tokens == 0 and got.num_cached_tokens == 0
    full = engine(model_dir, enable_prefix_caching=False)
    assert tokens_of(got) == tokens_of(full.run(prompt("cab", 1)))
    assert restarted.engine.tiers is not None
    assert restarted.engine.tiers.metrics()["disk"].corrupt_records >= 1
    restarted.engine.block_pool.check_invariants()
    assert restarted.engine.block_pool.num_used == 0


def test_purging_a_document_purges_its_segment(model_dir: str) -> None:
    blend = engine(model_dir, kv_reuse="blend")
    blend.run(prompt("abc"))
    salt = blend.engine.salt_for("")
    manager = blend.engine.kv_manager
    segments = {name: make_segment(salt, TEMPLATE, DOCS[name], BLOCK) for name in "bc"}
    assert all(segment_stored(manager, s) for s in segments.values())
    removed = blend.engine.purge_prefix(TEMPLATE + DOCS["b"], keep=[TEMPLATE + DOCS["c"]])
    assert removed["device"] > 0
    assert not segment_stored(manager, segments["b"])
    assert segment_stored(manager, segments["c"])  # its blocks, the template's among them, stay
    # c still blends; b is computed in place (and its segment computed again next to it).
    assert blend.run(prompt("acb", 1)).num_blended_tokens > 0
    assert segment_stored(manager, segments["b"])


def test_a_segment_whose_copy_does_not_fit_beside_it_is_computed_in_place(
    model_dir: str,
) -> None:
    """A pool that holds the prompt but not the prompt and the document's segment at once:
    the install cannot get room, and nothing else runs to free any. The document is
    computed in place instead of the request waiting for good."""
    probe = engine(model_dir)
    block_bytes = probe.engine.kv_cache[0].numel() * probe.engine.kv_cache.element_size()
    del probe
    # NOTE: 20 blocks: "cb" and its answer take 17; installing b's segment (the template
    # and b: 9 full blocks) beside the prompt's 14 blocks up to b's end takes 23.
    gib = 20.5 * block_bytes / 2**30
    blend = engine(model_dir, kv_reuse="blend", kv_cache_gib=gib, blend_recompute_ratio=0.0)
    full = engine(model_dir, enable_prefix_caching=False)
    assert blend.engine.block_pool.num_blocks == 20
    blend.run(prompt("ab"))  # computes b's segment
    segment = make_segment(blend.engine.salt_for(""), TEMPLATE, DOCS["b"], BLOCK)
    assert segment_stored(blend.engine.kv_manager, segment)
    p = prompt("cb")
    blend.engine.add_request("cb", p.token_ids, GREEDY, documents=p.documents)
    done = None
    for _ in range(500):  # NOTE: bounded: the bug waited for good
        for output in blend.engine.step():
            done = output if output.finished else done
        if not blend.engine.has_unfinished_requests():
            break
    assert done is not None, "the request never finished"
    assert tokens_of(done) == tokens_of(full.run(p))
    assert done.num_blended_tokens == 0
    blend.engine.block_pool.check_invariants()
    assert blend.engine.block_pool.num_used == 0


def test_installs_waiting_on_a_queued_segment_never_stall_the_engine(model_dir: str) -> None:
    """One running slot, held by a request whose install waits for a segment that the next
    request queued again (the segment was evicted): the segment's request cannot run until
    the slot is free, and nothing else runs: the document is computed in place instead."""
    blend = engine(model_dir, kv_reuse="blend", max_num_seqs=1, blend_recompute_ratio=0.0)
    full = engine(model_dir, enable_prefix_caching=False)
    blend.run(prompt("ab"))  # b's segment
    first, second = prompt("cb"), prompt("cb", 1)
    blend.engine.add_request("first", first.token_ids, GREEDY, documents=first.documents)
    blend.engine.step()  # admitted, with an install of b's segment planned
    blend.engine.reset_prefix_cache()  # the segment leaves, as an eviction would take it
    blend.engine.add_request("second", second.token_ids, GREEDY, documents=second.documents)
    done: dict[str, list[int]] = {}
    for _ in range(500):  # NOTE: bounded: the bug waited for good
        for output in blend.engine.step():
            if output.finished:
                done[output.request_id] = tokens_of(output)
        if not blend.engine.has_unfinished_requests():
            break
    assert done == {"first": tokens_of(full.run(first)), "second": tokens_of(full.run(second))}
    blend.engine.block_pool.check_invariants()
    assert blend.engine.block_pool.num_used == 0
