"""Encryption at rest of disk-tier records: AES-256-GCM under keys derived per salt.

The salt binds the model, the KV layout and the tenant, so each tenant's records are
sealed under a key of its own: ``HKDF-SHA256(master, info="ragserve-kv-record" | salt)``.
An encrypted record's header keeps no token ids, only a keyed digest of them
(``HMAC-SHA256(key, token bytes)``, 16 bytes) which verification compares. The payload
is ``nonce (12 bytes) | ciphertext | tag (16 bytes)``, authenticated together with the
block's identity (hash, parent, salt) as associated data.

Contract: a wrong or missing key never yields bytes: the digest or the tag fails, and
the record is a miss (``RecordError``). The AES-GCM itself is ``aes_gcm``'s: libcrypto
without the GIL where it loads, else the ``cryptography`` package (same bytes either way).
"""

from __future__ import annotations

import functools
import hmac
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvstore.aes_gcm import SEAL_OVERHEAD, AesGcm, AuthenticationError, new_aes_gcm

MIN_MASTER_BYTES = 32
CIPHER_NAME = "aes-256-gcm"


class CipherError(ValueError):
    """Sealed bytes that this key cannot open (another key, or damage)."""


class RecordCipher:
    """Seals and opens record payloads; thread-safe (keys are derived once per salt)."""

    def __init__(self, master_key: bytes, aes_gcm: Callable[[bytes], AesGcm] = new_aes_gcm) -> None:
        """``aes_gcm`` makes the AEAD for a derived key (tests pick an implementation)."""
        if len(master_key) < MIN_MASTER_BYTES:
            raise ValueError(
                f"the KV encryption key needs at least {MIN_MASTER_BYTES} bytes, got {len(master_key)}"
            )
        self._master = bytes(master_key)
        self._new_aes_gcm = aes_gcm

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> RecordCipher:
        """The key file's bytes (surrounding whitespace stripped) are the master key.
        Raises OSError when unreadable, ValueError when too short."""
        return cls(Path(path).read_bytes().strip())

    @functools.lru_cache(maxsize=256)  # noqa: B019 (one cipher per engine, few salts)
    def _aead(self, salt: bytes) -> tuple[AesGcm, bytes]:
        key = HKDF(
            algorithm=hashes.SHA256(), length=32, salt=None, info=b"ragserve-kv-record|" + salt
        ).derive(self._master)
        return self._new_aes_gcm(key), key

    @functools.cached_property
    def key_id(self) -> str:
        """A short public name of the master key (derived one way, so it reveals nothing of
        the key): stores shared by engines of other keys keep their records apart by it."""
        derived = HKDF(
            algorithm=hashes.SHA256(), length=8, salt=None, info=b"ragserve-kv-key-id"
        ).derive(self._master)
        return derived.hex()

    @property
    def implementation(self) -> str:
        """Which AES-GCM seals and opens: "libcrypto" or "cryptography"."""
        return self._aead(b"")[0].name

    def token_digest(self, salt: bytes, token_ids: Sequence[int]) -> bytes:
        _, key = self._aead(salt)
        # NOTE: one struct.pack and one-shot HMAC: this runs under the GIL for every record.
        data = struct.pack(f"<{len(token_ids)}I", *token_ids)
        return hmac.digest(key, data, "sha256")[:16]

    def seal(self, salt: bytes, identity: bytes, payload: bytes | memoryview) -> bytearray:
        """``nonce | ciphertext | tag`` of ``payload``, ``identity`` as associated data."""
        aead, _ = self._aead(salt)
        return aead.seal(payload, identity)

    def open_into(
        self, salt: bytes, identity: bytes, sealed: bytes | bytearray | memoryview, out: memoryview
    ) -> None:
        """Decrypt straight into ``out`` (exactly the plaintext's length); CipherError when
        the key or the bytes are wrong, and then ``out`` holds no usable bytes.

        NOTE: no copies on the way: the restore path reads many large blocks."""
        aead, _ = self._aead(salt)
        if memoryview(sealed).nbytes != out.nbytes + SEAL_OVERHEAD:
            raise CipherError("sealed payload has the wrong length")
        try:
            aead.open_into(sealed, identity, out)
        except AuthenticationError:
            raise CipherError("authentication failed (another key, or damaged)") from None

    def open_in_place(
        self, salt: bytes, identity: bytes, nonce: bytes, data: memoryview, tag: bytes
    ) -> None:
        """Decrypt a sealed payload read in parts (``nonce``, ciphertext ``data``, ``tag``)
        where ``data`` lies; CipherError as ``open_into``, and then ``data`` is zeroed.

        NOTE: the restore path reads the ciphertext straight into the destination: no
        scratch buffer, one pass less over every block."""
        aead, _ = self._aead(salt)
        try:
            aead.open_in_place(nonce, data, tag, identity)
        except AuthenticationError:
            # NOTE: never leave unauthenticated plaintext behind in a caller's buffer.
            data.cast("B")[:] = bytes(data.nbytes)
            raise CipherError("authentication failed (another key, or damaged)") from None


def identity_bytes(block_hash: bytes, parent_hash: bytes | None, salt: bytes) -> bytes:
    """The associated data binding a sealed payload to its block."""
    return block_hash + (parent_hash or b"") + salt
