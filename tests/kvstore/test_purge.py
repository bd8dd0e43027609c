"""Purging a token sequence's blocks: gone from the prefix cache, the CPU tier and the disk
files (bytes scanned), descendants included; blocks a kept sequence shares stay. Files and
directories the disk tier creates are private (0600/0700)."""

from __future__ import annotations

import stat
import struct
from pathlib import Path

import msgpack

from kvstore.purge import doomed_blocks
from kvstore.tier import salt_fingerprint
from tests.kvstore.tiered_cache import BS, SALT, TieredCache, chain

SHARED = list(range(1, 1 + 2 * BS))  # two blocks both documents start with
DOC = SHARED + list(range(500, 500 + 4 * BS))
OTHER = SHARED + list(range(900, 900 + 3 * BS))
QUESTION = DOC + list(range(700, 700 + 2 * BS))  # a prompt on DOC: its chain goes on


def _packed(tokens: list[int]) -> list[bytes]:
    """Encodings a file could hold these token ids in."""
    return [
        b"".join(msgpack.packb(t) for t in tokens),
        struct.pack(f"<{len(tokens)}I", *tokens),
        struct.pack(f"<{len(tokens)}q", *tokens),
    ]


def _files_holding(root: Path, tokens: list[int]) -> list[Path]:
    needles = _packed(tokens)
    return [
        path
        for path in root.rglob("*")
        if path.is_file() and any(needle in path.read_bytes() for needle in needles)
    ]


def test_links_close_over_children_and_spare_kept_chains() -> None:
    links = [(b"a", None), (b"b", b"a"), (b"c", b"b"), (b"d", b"c"), (b"x", b"a")]
    assert doomed_blocks([b"b", b"c"], [], links) == {b"b", b"c", b"d"}
    assert doomed_blocks([b"a", b"b"], [b"a"], links) == {b"b", b"c", b"d"}


def test_purge_removes_a_sequence_from_every_tier(tmp_path: Path) -> None:
    cache = TieredCache(num_blocks=32, cpu_slots=8, disk_dir=tmp_path)
    for tokens in (OTHER, QUESTION):
        cache.compute(tokens, persist=True)  # written through to disk at once
    cache.stack.flush()
    cpu, disk = cache.tier("cpu"), cache.tier("disk")
    cache.evict_to_tiers()  # device -> CPU (and what the CPU tier sheds, to disk)
    own = chain(DOC)[2:]
    assert all(disk.contains(identity) for identity in chain(QUESTION))
    assert _files_holding(tmp_path, DOC[2 * BS : 3 * BS])

    # Back on the device too: the purge must find it in every place at once.
    cache.compute(DOC)
    owned, kept = [i.block_hash for i in chain(DOC)], [i.block_hash for i in chain(OTHER)]
    counts = cache.manager.purge(SALT, owned, kept)
    assert counts.device == len(own)
    assert counts.tiers["disk"] == len(chain(QUESTION)) - 2 and counts.tiers["cpu"] >= 1
    for identity in chain(QUESTION)[2:]:
        assert cache.pool.lookup(identity) is None
        assert not cpu.contains(identity) and not disk.contains(identity)
    for identity in chain(OTHER):  # shared and other blocks stay
        assert disk.contains(identity)
    assert _files_holding(tmp_path, DOC[2 * BS : 3 * BS]) == []
    assert _files_holding(tmp_path, QUESTION[-BS:]) == []
    assert _files_holding(tmp_path, OTHER[-BS:])  # the scan does find what is there
    for path in tmp_path.rglob("*"):
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    assert salt_fingerprint(SALT) in {p.name for p in tmp_path.iterdir()}


def test_a_sequence_live_across_the_purge_never_brings_its_blocks_back(tmp_path: Path) -> None:
    cache = TieredCache(num_blocks=32, cpu_slots=8, disk_dir=tmp_path)
    cache.compute(OTHER, persist=True)
    # A question on DOC, admitted before the purge: half its prompt computed and indexed,
    # the rest still to come; a second one waits, not yet allocated.
    running, waiting = cache.alloc(QUESTION), cache.alloc(QUESTION)
    running.persist = waiting.persist = True
    assert cache.manager.allocate(running, len(QUESTION))
    half = 4 * BS
    cache.manager.commit(running, QUESTION, half)
    assert cache.pool.lookup(chain(QUESTION)[3]) is not None

    owned, kept = [i.block_hash for i in chain(DOC)], [i.block_hash for i in chain(OTHER)]
    cache.manager.purge(SALT, owned, kept, live=[running, waiting])
    assert running.register_limit == waiting.register_limit == 2  # the first block DOC owns

    # Both finish after the purge: their blocks are used, never indexed, demoted or written.
    cache.manager.commit(running, QUESTION, len(QUESTION))
    cache.manager.free(running)
    assert cache.manager.allocate(waiting, len(QUESTION))
    cache.manager.commit(waiting, QUESTION, len(QUESTION))
    cache.manager.free(waiting)
    cache.evict_to_tiers()
    cpu, disk = cache.tier("cpu"), cache.tier("disk")
    for identity in chain(QUESTION)[2:]:
        assert cache.pool.lookup(identity) is None
        assert not cpu.contains(identity) and not disk.contains(identity)
    assert _files_holding(tmp_path, DOC[2 * BS : 3 * BS]) == []
    assert _files_holding(tmp_path, QUESTION[-BS:]) == []
    assert disk.contains(chain(OTHER)[-1])  # the tiers still take other blocks

    # A request added after the purge is a new one: it caches its blocks as usual.
    cache.compute(QUESTION)
    assert cache.pool.lookup(chain(QUESTION)[-1]) is not None
