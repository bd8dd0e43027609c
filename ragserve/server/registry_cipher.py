"""Encryption of the registry's document text (token ids and metadata) at rest.

Under the same key file as the disk tier's records, with its own derivation:
``HKDF-SHA256(master, info="ragserve-registry" | tenant namespace)``, so each tenant's
rows are sealed under a key of its own. A sealed field is ``nonce (12) | AES-256-GCM
ciphertext | tag``, bound to the row's (namespace, id) as associated data, so a sealed
field moved to another row does not open.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

_NONCE = 12
MIN_KEY_BYTES = 32


class SealedFieldError(ValueError):
    """A sealed field this key cannot open: another key, or damaged bytes."""


class RegistryCipher:
    def __init__(self, master_key: bytes) -> None:
        if len(master_key) < MIN_KEY_BYTES:
            raise ValueError(f"the encryption key needs at least {MIN_KEY_BYTES} bytes")
        self._master = bytes(master_key)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> RegistryCipher:
        """The file's bytes, surrounding whitespace stripped (as the disk tier reads it)."""
        return cls(Path(path).read_bytes().strip())

    @functools.lru_cache(maxsize=256)  # noqa: B019 (one cipher per server, few tenants)
    def _aead(self, namespace: str) -> AESGCM:
        info = b"ragserve-registry|" + namespace.encode()
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(self._master)
        return AESGCM(key)

    def seal(self, namespace: str, doc_id: str, data: bytes) -> bytes:
        nonce = os.urandom(_NONCE)
        return nonce + self._aead(namespace).encrypt(nonce, data, _bound(namespace, doc_id))

    def open(self, namespace: str, doc_id: str, sealed: bytes) -> bytes:
        try:
            return self._aead(namespace).decrypt(
                sealed[:_NONCE], sealed[_NONCE:], _bound(namespace, doc_id)
            )
        except (InvalidTag, ValueError):
            raise SealedFieldError("cannot be opened with this key") from None


def _bound(namespace: str, doc_id: str) -> bytes:
    return namespace.encode() + b"\x00" + doc_id.encode()
