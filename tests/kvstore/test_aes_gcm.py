"""AES-256-GCM through libcrypto and through ``cryptography``: the same bytes both ways,
and anything that does not authenticate is an error, never plaintext."""

from __future__ import annotations

import ctypes.util
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvstore import aes_gcm
from kvstore.aes_gcm import (
    NONCE_BYTES,
    SEAL_OVERHEAD,
    TAG_BYTES,
    AesGcm,
    AuthenticationError,
    LibcryptoAesGcm,
    PyCaAesGcm,
    new_aes_gcm,
)

KEY = bytes(range(32))
AAD = b"block-hash|parent|salt"


def libcrypto(key: bytes) -> AesGcm:
    try:
        aes_gcm.load_libcrypto()
    except OSError as exc:
        pytest.skip(f"no usable libcrypto here: {exc}")
    return LibcryptoAesGcm(key)


IMPLEMENTATIONS: dict[str, Callable[[bytes], AesGcm]] = {
    "libcrypto": libcrypto,
    "cryptography": PyCaAesGcm,
}
PAIRS = [(s, o) for s in IMPLEMENTATIONS for o in IMPLEMENTATIONS]


def open_(impl: AesGcm, sealed: bytes | bytearray, aad: bytes = AAD) -> bytes:
    out = bytearray(len(sealed) - SEAL_OVERHEAD)
    impl.open_into(sealed, aad, memoryview(out))
    return bytes(out)


@pytest.mark.parametrize(("sealer", "opener"), PAIRS)
@pytest.mark.parametrize("size", [1, 15, 16, 4097, 768 * 1024])
def test_either_opens_what_either_sealed(sealer: str, opener: str, size: int) -> None:
    data = os.urandom(size)
    sealed = IMPLEMENTATIONS[sealer](KEY).seal(data, AAD)
    assert len(sealed) == size + SEAL_OVERHEAD
    if size >= 16:  # NOTE: a byte or a few can turn up in random bytes by chance
        assert data not in sealed
    assert open_(IMPLEMENTATIONS[opener](KEY), sealed) == data


def open_in_place(impl: AesGcm, sealed: bytearray, aad: bytes = AAD) -> bytes:
    """Open ``sealed`` the way the restore path does: ciphertext decrypted where it lies."""
    data = memoryview(bytearray(sealed[NONCE_BYTES:-TAG_BYTES]))
    impl.open_in_place(bytes(sealed[:NONCE_BYTES]), data, bytes(sealed[-TAG_BYTES:]), aad)
    return bytes(data)


@pytest.mark.parametrize(("sealer", "opener"), PAIRS)
def test_either_opens_in_place_what_either_sealed(sealer: str, opener: str) -> None:
    data = os.urandom(100_000)
    sealed = IMPLEMENTATIONS[sealer](KEY).seal(data, AAD)
    assert open_in_place(IMPLEMENTATIONS[opener](KEY), sealed) == data
    for where in ("nonce", "ciphertext", "tag"):
        with pytest.raises(AuthenticationError):
            open_in_place(IMPLEMENTATIONS[opener](KEY), damaged(sealed, where))
    with pytest.raises(AuthenticationError):
        open_in_place(IMPLEMENTATIONS[opener](KEY), sealed, AAD + b"x")


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_a_tensor_is_sealed_from_its_memory_and_opened_into_one(name: str) -> None:
    impl = IMPLEMENTATIONS[name](KEY)
    block = torch.randn(3, 5, 7)
    sealed = impl.seal(block.numpy().data, AAD)
    target = torch.empty_like(block)
    impl.open_into(sealed, AAD, target.view(torch.uint8).reshape(-1).numpy().data)
    assert torch.equal(target, block)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_each_nonce_is_fresh(name: str) -> None:
    impl = IMPLEMENTATIONS[name](KEY)
    first, second = impl.seal(b"same", AAD), impl.seal(b"same", AAD)
    assert first[:12] != second[:12] and first != second


def damaged(sealed: bytearray, where: str) -> bytearray:
    index = {"nonce": 3, "ciphertext": 12 + 100, "tag": len(sealed) - 1}[where]
    copy = bytearray(sealed)
    copy[index] ^= 0x01
    return copy


@pytest.mark.parametrize(("sealer", "opener"), PAIRS)
@pytest.mark.parametrize("where", ["nonce", "ciphertext", "tag"])
def test_a_flipped_bit_is_rejected(sealer: str, opener: str, where: str) -> None:
    sealed = IMPLEMENTATIONS[sealer](KEY).seal(os.urandom(1000), AAD)
    with pytest.raises(AuthenticationError):
        open_(IMPLEMENTATIONS[opener](KEY), damaged(sealed, where))


@pytest.mark.parametrize(("sealer", "opener"), PAIRS)
def test_another_key_or_other_associated_data_is_rejected(sealer: str, opener: str) -> None:
    sealed = IMPLEMENTATIONS[sealer](KEY).seal(os.urandom(1000), AAD)
    with pytest.raises(AuthenticationError):
        open_(IMPLEMENTATIONS[opener](bytes(32)), sealed)
    with pytest.raises(AuthenticationError):
        open_(IMPLEMENTATIONS[opener](KEY), sealed, AAD + b"x")


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_a_truncated_payload_is_rejected(name: str) -> None:
    impl = IMPLEMENTATIONS[name](KEY)
    sealed = impl.seal(os.urandom(100), AAD)
    with pytest.raises(AuthenticationError):
        impl.open_into(sealed[:-1], AAD, memoryview(bytearray(100)))


def test_large_data_crosses_update_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Data longer than one EVP update (an int's worth, shrunk here) seals in chunks."""
    impl = libcrypto(KEY)
    monkeypatch.setattr(aes_gcm, "_MAX_UPDATE", 1000)
    data = os.urandom(4500)
    sealed = impl.seal(data, AAD)
    assert open_(PyCaAesGcm(KEY), sealed) == data
    assert open_(impl, PyCaAesGcm(KEY).seal(data, AAD)) == data


@pytest.fixture
def no_libcrypto(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """libcrypto candidates that are not libcrypto: a non-library file and libc."""
    fake = tmp_path / "libcrypto.so.3"
    fake.write_bytes(b"not a shared library")
    candidates = [str(fake)] + [name for name in (ctypes.util.find_library("c"),) if name]
    monkeypatch.setattr(aes_gcm, "_libcrypto_candidates", lambda: candidates)
    monkeypatch.setattr(aes_gcm, "_fallback_logged", aes_gcm.threading.Event())
    aes_gcm.load_libcrypto.cache_clear()
    yield
    aes_gcm.load_libcrypto.cache_clear()


@pytest.mark.usefixtures("no_libcrypto")
def test_without_libcrypto_falls_back_and_says_why_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=aes_gcm.__name__):
        first, second = new_aes_gcm(KEY), new_aes_gcm(KEY)
    assert isinstance(first, PyCaAesGcm) and isinstance(second, PyCaAesGcm)
    warnings = [r for r in caplog.records if "falls back" in r.getMessage()]
    assert len(warnings) == 1 and "libcrypto.so.3" in warnings[0].getMessage()
    data = os.urandom(500)
    assert open_(first, PyCaAesGcm(KEY).seal(data, AAD)) == data


def test_with_libcrypto_the_gil_free_one_is_chosen() -> None:
    libcrypto(KEY)  # skips where none loads
    assert isinstance(new_aes_gcm(KEY), LibcryptoAesGcm)
