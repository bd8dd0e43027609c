"""Names of KV records in a shared key-value store, and what this process knows of them.

Key: ``<prefix>:<salt fingerprint>:<block hash hex>``. The salt fingerprint binds the model
fingerprint, block size, KV dtype and tenant, so engines of one model and tenant share
keys and nothing else does; the full salt and the token ids are verified on every read.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from kvstore.tier import BlockLike, record_key

DEFAULT_KEY_PREFIX = "ragserve:kv:v1"


def block_key(prefix: str, meta: BlockLike) -> bytes:
    key = record_key(meta)
    return f"{prefix}:{key.fingerprint}:{key.block_hash.hex()}".encode()


def fingerprint_pattern(prefix: str, fingerprint: str) -> str:
    """A SCAN pattern matching every key under ``fingerprint``."""
    return f"{prefix}:{fingerprint}:*"


def key_hash(key: bytes) -> bytes:
    """The block hash a key names (inverse of ``block_key``'s last field)."""
    return bytes.fromhex(key.rsplit(b":", 1)[1].decode())


class KnownKeys:
    """Keys this process believes the store holds (it wrote or read them), for
    ``present_memory_s`` and LRU-bounded, and keys whose load just missed, reported absent
    for ``miss_memory_s``.

    The belief may be stale (the store evicts, restarts, or another engine deletes): a
    load then misses and calls ``missed``. A belief no load tests (a block only written)
    lapses after ``present_memory_s``, so the next write of the block asks the store
    again instead of being skipped for good. Remembering a miss for a while is what keeps
    a sequence that waits for a load from waiting forever on a key that ``contains``
    keeps reporting. Thread-safe.
    """

    def __init__(
        self,
        max_keys: int = 1 << 18,
        miss_memory_s: float = 1.0,
        present_memory_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._present: OrderedDict[bytes, float] = OrderedDict()
        self._missed: OrderedDict[bytes, float] = OrderedDict()
        self._max = max_keys
        self._miss_memory_s = miss_memory_s
        self._present_memory_s = present_memory_s
        self._clock = clock
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._present)

    def state(self, key: bytes) -> bool | None:
        """True: believed present; False: missed recently; None: unknown (ask the store)."""
        with self._lock:
            now = self._clock()
            until = self._present.get(key)
            if until is not None:
                if now < until:
                    self._present.move_to_end(key)
                    return True
                del self._present[key]
            deadline = self._missed.get(key)
            if deadline is None:
                return None
            if now < deadline:
                return False
            del self._missed[key]
            return None

    def present(self, key: bytes) -> None:
        with self._lock:
            self._missed.pop(key, None)
            self._present[key] = self._clock() + self._present_memory_s
            self._present.move_to_end(key)
            while len(self._present) > self._max:
                self._present.popitem(last=False)

    def missed(self, key: bytes) -> None:
        with self._lock:
            self._present.pop(key, None)
            self._missed[key] = self._clock() + self._miss_memory_s
            self._missed.move_to_end(key)
            while len(self._missed) > self._max:
                self._missed.popitem(last=False)

    def forget(self, key: bytes) -> None:
        with self._lock:
            self._present.pop(key, None)
            self._missed.pop(key, None)

    def clear(self) -> None:
        """Forget everything (the store may have restarted empty)."""
        with self._lock:
            self._present.clear()
            self._missed.clear()
