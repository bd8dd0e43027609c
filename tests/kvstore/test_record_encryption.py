"""Disk-tier records encrypted at rest: no token ids in the bytes, round trips with the
key, and a wrong or missing key (or a plain record under a key) is a miss, never garbage."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import torch

from kvstore.aes_gcm import SEAL_OVERHEAD, AesGcm, LibcryptoAesGcm, PyCaAesGcm, load_libcrypto
from kvstore.disk_tier import DiskTier
from kvstore.record_cipher import CipherError, RecordCipher, identity_bytes
from kvstore.tier import BlockMeta
from tests.kvstore.tier_blocks import SALT, SHAPE, bit_equal, random_block

KEY = b"k" * 32
TOKENS = (70001, 70002, 70003, 70004)
META = BlockMeta(b"\x11" * 16, None, TOKENS, SALT)


def tier(
    root: Path, key: bytes | None, aes_gcm: Callable[[bytes], AesGcm] | None = None
) -> DiskTier:
    if key is None:
        cipher = None
    else:
        cipher = RecordCipher(key) if aes_gcm is None else RecordCipher(key, aes_gcm)
    return DiskTier(SHAPE, torch.float32, 1 << 22, root, cipher=cipher)


def write(root: Path, key: bytes | None) -> torch.Tensor:
    block = random_block(torch.float32, 3)
    with tier(root, key) as disk:
        assert disk.put(META, block, blocking=True)
        disk.flush()
    return block


def record_bytes(root: Path) -> bytes:
    (path,) = root.rglob("*.kv")
    return path.read_bytes()


def test_round_trip_without_plaintext(tmp_path: Path) -> None:
    block = write(tmp_path, KEY)
    raw = record_bytes(tmp_path)
    for needle in (b"".join(msgpack.packb(t) for t in TOKENS), struct.pack("<4I", *TOKENS)):
        assert needle not in raw
    assert block.numpy().tobytes() not in raw  # the payload is sealed too
    with tier(tmp_path, KEY) as disk:
        loaded = disk.get(META)
        assert loaded is not None and bit_equal(loaded, block)


@pytest.mark.parametrize("reader_key", [b"w" * 32, None])
def test_wrong_or_missing_key_misses(tmp_path: Path, reader_key: bytes | None) -> None:
    write(tmp_path, KEY)
    with tier(tmp_path, reader_key) as disk:
        assert disk.get(META) is None
        assert (
            disk.metrics().misses + disk.metrics().foreign_records + disk.metrics().corrupt_records
            >= 1
        )


def test_a_plain_record_misses_under_a_key(tmp_path: Path) -> None:
    write(tmp_path, None)
    with tier(tmp_path, KEY) as disk:
        assert disk.get(META) is None


def test_short_keys_are_refused() -> None:
    with pytest.raises(ValueError):
        RecordCipher(b"short")


IMPLEMENTATIONS: dict[str, Callable[[bytes], AesGcm]] = {
    "libcrypto": LibcryptoAesGcm,
    "cryptography": PyCaAesGcm,
}


@pytest.mark.parametrize(
    ("writer", "reader"), [("libcrypto", "cryptography"), ("cryptography", "libcrypto")]
)
def test_records_open_with_either_aes_gcm(tmp_path: Path, writer: str, reader: str) -> None:
    try:
        load_libcrypto()
    except OSError as exc:
        pytest.skip(f"no usable libcrypto here: {exc}")
    block = random_block(torch.float32, 5)
    with tier(tmp_path, KEY, IMPLEMENTATIONS[writer]) as disk:
        assert disk.put(META, block, blocking=True)
        disk.flush()
    with tier(tmp_path, KEY, IMPLEMENTATIONS[reader]) as disk:
        loaded = disk.get(META)
        assert loaded is not None and bit_equal(loaded, block)


@pytest.mark.parametrize("where", ["nonce", "ciphertext", "tag"])
def test_a_flipped_payload_byte_is_a_miss(tmp_path: Path, where: str) -> None:
    write(tmp_path, KEY)
    (path,) = tmp_path.rglob("*.kv")
    raw = bytearray(path.read_bytes())
    payload_start = len(raw) - (random_block(torch.float32, 3).numel() * 4 + SEAL_OVERHEAD)
    index = {"nonce": payload_start, "ciphertext": payload_start + 20, "tag": len(raw) - 1}
    raw[index[where]] ^= 0x40
    path.write_bytes(bytes(raw))
    with tier(tmp_path, KEY) as disk:
        assert disk.get(META) is None
        assert disk.metrics().foreign_records == 1


@pytest.mark.parametrize("name", ["libcrypto", "cryptography"])
def test_the_cipher_rejects_other_identities_and_salts(name: str) -> None:
    try:
        load_libcrypto()
    except OSError as exc:
        pytest.skip(f"no usable libcrypto here: {exc}")
    cipher = RecordCipher(KEY, IMPLEMENTATIONS[name])
    payload = random_block(torch.float32, 7).numpy().tobytes()
    identity = identity_bytes(META.block_hash, None, SALT)
    sealed = cipher.seal(SALT, identity, payload)
    out = memoryview(bytearray(len(payload)))
    cipher.open_into(SALT, identity, sealed, out)
    assert bytes(out) == payload
    for salt, other in [(SALT, identity_bytes(b"\x12" * 16, None, SALT)), (b"other", identity)]:
        with pytest.raises(CipherError):
            cipher.open_into(salt, other, sealed, out)
    with pytest.raises(CipherError):
        RecordCipher(b"w" * 32, IMPLEMENTATIONS[name]).open_into(SALT, identity, sealed, out)


def test_a_failed_open_in_place_leaves_no_plaintext() -> None:
    cipher = RecordCipher(KEY)
    payload = random_block(torch.float32, 8).numpy().tobytes()
    identity = identity_bytes(META.block_hash, None, SALT)
    sealed = cipher.seal(SALT, identity, payload)
    nonce, tag = bytes(sealed[:12]), bytearray(sealed[-16:])
    tag[0] ^= 1
    data = memoryview(bytearray(sealed[12:-16]))
    with pytest.raises(CipherError):
        cipher.open_in_place(SALT, identity, nonce, data, bytes(tag))
    assert bytes(data) == bytes(len(payload))
