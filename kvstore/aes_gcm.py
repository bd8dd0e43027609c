"""AES-256-GCM sealing of one buffer: ``nonce (12 bytes) | ciphertext | tag (16 bytes)``.

Two interchangeable implementations produce and accept the same bytes:

- ``LibcryptoAesGcm`` calls OpenSSL's libcrypto (EVP) through ``ctypes``, which releases
  the GIL for the bulk encrypt/decrypt call, so the disk tier's reader threads decrypt on
  every core at once; it decrypts straight into the caller's buffer.
- ``PyCaAesGcm`` uses the ``cryptography`` package's ``AESGCM``, which holds the GIL
  while it runs: correct, but one core's worth of AES-GCM for the whole process.

``new_aes_gcm(key)`` returns the first when libcrypto can be loaded and passes a
known-answer check against the second, else the second (and logs why, once).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import threading
from typing import Any, Protocol

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

logger = logging.getLogger(__name__)

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
SEAL_OVERHEAD = NONCE_BYTES + TAG_BYTES

Buffer = bytes | bytearray | memoryview

# EVP_CIPHER_CTX_ctrl commands (openssl/evp.h; unchanged since OpenSSL 1.0.1)
_CTRL_GCM_GET_TAG = 0x10
_CTRL_GCM_SET_TAG = 0x11
# NOTE: EVP_*Update takes an int length: bulk data goes through in chunks below 2 GiB.
_MAX_UPDATE = 1 << 30


class AuthenticationError(ValueError):
    """Sealed bytes that fail authentication (another key, other associated data, damage)."""


class AesGcm(Protocol):
    """Seals and opens under one 32-byte key; implementations are thread-safe."""

    name: str

    def seal(self, payload: Buffer, aad: bytes) -> bytearray:
        """``nonce | ciphertext | tag`` of ``payload`` under a fresh random nonce."""
        ...

    def open_into(self, sealed: Buffer, aad: bytes, out: memoryview) -> None:
        """Decrypt ``sealed`` into ``out`` (``len(sealed) - SEAL_OVERHEAD`` bytes).

        Raises AuthenticationError when the tag does not verify; ``out`` then holds no
        usable bytes (it may hold unauthenticated plaintext: never hand it on)."""
        ...

    def open_in_place(self, nonce: bytes, data: memoryview, tag: bytes, aad: bytes) -> None:
        """Decrypt the ciphertext ``data`` where it lies (a sealed payload read in parts).

        Raises AuthenticationError as ``open_into`` does; ``data`` then holds no usable
        bytes."""
        ...


def _check_sizes(sealed_len: int, out_len: int) -> None:
    if sealed_len != out_len + SEAL_OVERHEAD:
        raise AuthenticationError(
            f"sealed length {sealed_len} does not fit a plaintext of {out_len} bytes"
        )


class PyCaAesGcm:
    """AES-GCM through ``cryptography`` (holds the GIL while it runs)."""

    name = "cryptography"

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"AES-256 needs a {KEY_BYTES}-byte key, got {len(key)}")
        self._aead = AESGCM(key)

    def seal(self, payload: Buffer, aad: bytes) -> bytearray:
        nonce = os.urandom(NONCE_BYTES)
        sealed = bytearray(nonce)
        sealed += self._aead.encrypt(nonce, bytes(payload), aad)
        return sealed

    def open_into(self, sealed: Buffer, aad: bytes, out: memoryview) -> None:
        view = memoryview(sealed).cast("B")
        _check_sizes(len(view), out.nbytes)
        try:
            self._aead.decrypt_into(bytes(view[:NONCE_BYTES]), view[NONCE_BYTES:], aad, out)
        except InvalidTag:
            raise AuthenticationError("authentication failed") from None

    def open_in_place(self, nonce: bytes, data: memoryview, tag: bytes, aad: bytes) -> None:
        if len(nonce) != NONCE_BYTES or len(tag) != TAG_BYTES:
            raise AuthenticationError("nonce or tag of the wrong length")
        # NOTE: AESGCM takes ciphertext and tag as one buffer, not aliasing the output:
        # one copy here (this is the slow path already).
        sealed = bytearray(nonce)
        sealed += data
        sealed += tag
        self.open_into(sealed, aad, data)


class _Evp:
    """The few libcrypto EVP functions used here, bound with their C signatures.

    NOTE: two handles on one library: ``bulk`` (CDLL) releases the GIL around each call
    and runs only the long encrypt/decrypt of the data; ``quick`` (PyDLL) keeps the GIL
    for the microsecond set-up calls, since taking the GIL back after each one would make
    every record wait its turn behind the other reader threads again.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        quick = ctypes.PyDLL(path)
        bulk = ctypes.CDLL(path)
        ptr, c_int, int_p = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int)
        update_args = [ptr, ptr, int_p, ptr, c_int]
        self.ctx_new = _bind(quick, "EVP_CIPHER_CTX_new", ptr, [])
        self.ctx_free = _bind(quick, "EVP_CIPHER_CTX_free", None, [ptr])
        self.ctrl = _bind(quick, "EVP_CIPHER_CTX_ctrl", c_int, [ptr, c_int, c_int, ptr])
        self.encrypt_init = _bind(quick, "EVP_EncryptInit_ex", c_int, [ptr] * 5)
        self.encrypt_aad = _bind(quick, "EVP_EncryptUpdate", c_int, update_args)
        self.encrypt_bulk = _bind(bulk, "EVP_EncryptUpdate", c_int, update_args)
        self.encrypt_final = _bind(quick, "EVP_EncryptFinal_ex", c_int, [ptr, ptr, int_p])
        self.decrypt_init = _bind(quick, "EVP_DecryptInit_ex", c_int, [ptr] * 5)
        self.decrypt_aad = _bind(quick, "EVP_DecryptUpdate", c_int, update_args)
        self.decrypt_bulk = _bind(bulk, "EVP_DecryptUpdate", c_int, update_args)
        self.decrypt_final = _bind(quick, "EVP_DecryptFinal_ex", c_int, [ptr, ptr, int_p])
        self.cipher = _aes_256_gcm(quick)


def _bind(lib: ctypes.CDLL, name: str, restype: Any, argtypes: list[Any]) -> Any:
    """``lib.name`` with its C signature (AttributeError when the symbol is missing)."""
    function = getattr(lib, name)
    function.restype, function.argtypes = restype, argtypes
    return function


def _aes_256_gcm(lib: ctypes.CDLL) -> int:
    """The cipher object: fetched once on OpenSSL 3 (saves a lookup per record), else the
    legacy static one (OpenSSL 1.1)."""
    try:
        fetch = lib.EVP_CIPHER_fetch
    except AttributeError:
        legacy = lib.EVP_aes_256_gcm
        legacy.restype, legacy.argtypes = ctypes.c_void_p, []
        cipher = legacy()
    else:
        fetch.restype = ctypes.c_void_p
        fetch.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
        cipher = fetch(None, b"AES-256-GCM", None)
    if not cipher:
        raise OSError("libcrypto has no AES-256-GCM")
    return int(cipher)


def _address(buffer: Buffer) -> tuple[int, object]:
    """The address of a contiguous buffer's first byte, and the object that keeps it alive.

    NOTE: ctypes' from_buffer is the cheap way (about 1 µs, under the GIL) but needs a
    writable buffer; numpy takes read-only ones (bytes) too."""
    view = memoryview(buffer).cast("B")
    if not view.readonly and view.nbytes:
        anchor = ctypes.c_char.from_buffer(view)
        return ctypes.addressof(anchor), anchor
    array = np.frombuffer(view, dtype=np.uint8)
    return int(array.ctypes.data), array


class LibcryptoAesGcm:
    """AES-GCM through libcrypto's EVP interface; the bulk call runs without the GIL."""

    name = "libcrypto"

    def __init__(self, key: bytes, evp: _Evp | None = None) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"AES-256 needs a {KEY_BYTES}-byte key, got {len(key)}")
        self._key = ctypes.create_string_buffer(bytes(key), KEY_BYTES)
        self._evp = evp if evp is not None else load_libcrypto()

    def seal(self, payload: Buffer, aad: bytes) -> bytearray:
        evp = self._evp
        size = memoryview(payload).nbytes
        sealed = bytearray(NONCE_BYTES + size + TAG_BYTES)
        nonce = os.urandom(NONCE_BYTES)
        sealed[:NONCE_BYTES] = nonce
        out_addr, out_keep = _address(sealed)
        in_addr, in_keep = _address(payload)
        ctx = self._context(evp.encrypt_init, nonce)
        try:
            written = ctypes.c_int()
            self._aad(evp.encrypt_aad, ctx, aad)
            _bulk(evp.encrypt_bulk, ctx, out_addr + NONCE_BYTES, in_addr, size)
            tag_addr = out_addr + NONCE_BYTES + size
            _ok(evp.encrypt_final(ctx, tag_addr, ctypes.byref(written)), "EncryptFinal")
            _ok(evp.ctrl(ctx, _CTRL_GCM_GET_TAG, TAG_BYTES, tag_addr), "GET_TAG")
        finally:
            evp.ctx_free(ctx)
        del out_keep, in_keep
        return sealed

    def open_into(self, sealed: Buffer, aad: bytes, out: memoryview) -> None:
        view = memoryview(sealed).cast("B")
        _check_sizes(len(view), out.nbytes)
        size = out.nbytes
        in_addr, in_keep = _address(view)
        nonce, tag = bytes(view[:NONCE_BYTES]), bytes(view[NONCE_BYTES + size :])
        self._open(nonce, in_addr + NONCE_BYTES, out, tag, aad)
        del in_keep

    def open_in_place(self, nonce: bytes, data: memoryview, tag: bytes, aad: bytes) -> None:
        if len(nonce) != NONCE_BYTES or len(tag) != TAG_BYTES:
            raise AuthenticationError("nonce or tag of the wrong length")
        data = data.cast("B")
        addr, keep = _address(data)
        # NOTE: EVP's GCM decrypts with input and output at the same address.
        self._open(nonce, addr, data, tag, aad)
        del keep

    def _open(self, nonce: bytes, in_addr: int, out: memoryview, tag: bytes, aad: bytes) -> None:
        """Decrypt ``out.nbytes`` bytes at ``in_addr`` into ``out`` and check ``tag``."""
        evp = self._evp
        out_addr, out_keep = _address(out)
        ctx = self._context(evp.decrypt_init, nonce)
        try:
            self._aad(evp.decrypt_aad, ctx, aad)
            _bulk(evp.decrypt_bulk, ctx, out_addr, in_addr, out.nbytes)
            tag_buffer = ctypes.create_string_buffer(tag, TAG_BYTES)
            _ok(evp.ctrl(ctx, _CTRL_GCM_SET_TAG, TAG_BYTES, tag_buffer), "SET_TAG")
            written = ctypes.c_int()
            # NOTE: GCM's final writes nothing; the pointer only has to be valid.
            verified = evp.decrypt_final(ctx, tag_buffer, ctypes.byref(written))
        finally:
            evp.ctx_free(ctx)
        del out_keep
        if verified <= 0:
            raise AuthenticationError("authentication failed")

    def _context(self, init: Any, nonce: bytes) -> int:
        ctx = self._evp.ctx_new()
        if not ctx:
            raise MemoryError("EVP_CIPHER_CTX_new failed")
        # NOTE: 12 bytes is GCM's default IV length: no SET_IVLEN call needed.
        if init(ctx, self._evp.cipher, None, self._key, nonce) != 1:
            self._evp.ctx_free(ctx)
            raise RuntimeError("EVP cipher init failed")
        return int(ctx)

    @staticmethod
    def _aad(update: Any, ctx: int, aad: bytes) -> None:
        if aad:
            written = ctypes.c_int()
            _ok(update(ctx, None, ctypes.byref(written), aad, len(aad)), "AAD update")


def _bulk(update: Any, ctx: int, out_addr: int, in_addr: int, size: int) -> None:
    """Encrypt or decrypt ``size`` bytes (GIL released by ctypes during each call)."""
    written = ctypes.c_int()
    done = 0
    while done < size:
        step = min(size - done, _MAX_UPDATE)
        _ok(update(ctx, out_addr + done, ctypes.byref(written), in_addr + done, step), "update")
        if written.value != step:
            raise RuntimeError(f"EVP update wrote {written.value} of {step} bytes")
        done += step


def _ok(result: int, what: str) -> None:
    if result != 1:
        raise RuntimeError(f"libcrypto {what} failed")


def _libcrypto_candidates() -> list[str]:
    """Where libcrypto may be: the linker's search, then the one this Python's own
    ``hashlib`` has already loaded (found in /proc/self/maps on Linux)."""
    found = [name for name in (ctypes.util.find_library("crypto"),) if name]
    try:
        import _hashlib  # noqa: F401  (maps the interpreter's libcrypto, if any)

        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if "/libcrypto.so" in path and path not in found:
                    found.append(path)
    except (ImportError, OSError):
        pass
    return found


@functools.lru_cache(maxsize=1)
def load_libcrypto() -> _Evp:
    """Bind libcrypto once per process and prove it against ``cryptography`` with a
    known-answer round trip. Raises OSError (with every reason) when no candidate works."""
    reasons: list[str] = []
    for candidate in _libcrypto_candidates():
        try:
            evp = _Evp(candidate)
            _known_answer(evp)
            return evp
        except (OSError, AttributeError, RuntimeError, ValueError, ctypes.ArgumentError) as exc:
            reasons.append(f"{candidate}: {exc}")
    raise OSError("; ".join(reasons) or "no libcrypto found")


def _known_answer(evp: _Evp) -> None:
    """Both implementations must open each other's bytes and reject a damaged tag."""
    key, aad, data = bytes(range(32)), b"known-answer", bytes(range(256)) * 5
    ours, theirs = LibcryptoAesGcm(key, evp), PyCaAesGcm(key)
    out = memoryview(bytearray(len(data)))
    theirs.open_into(ours.seal(data, aad), aad, out)
    ours.open_into(theirs.seal(data, aad), aad, out)
    if bytes(out) != data:
        raise RuntimeError("libcrypto's AES-GCM disagrees with cryptography's")
    sealed = theirs.seal(data, aad)
    in_place = memoryview(sealed)[NONCE_BYTES:-TAG_BYTES]
    ours.open_in_place(bytes(sealed[:NONCE_BYTES]), in_place, bytes(sealed[-TAG_BYTES:]), aad)
    if bytes(in_place) != data:
        raise RuntimeError("libcrypto's AES-GCM in place disagrees with cryptography's")
    damaged = ours.seal(data, aad)
    damaged[-1] ^= 1
    try:
        ours.open_into(damaged, aad, out)
    except AuthenticationError:
        return
    raise RuntimeError("libcrypto accepted a damaged tag")


_fallback_logged = threading.Event()


def new_aes_gcm(key: bytes) -> AesGcm:
    """The GIL-free implementation when libcrypto works here, else ``cryptography``'s."""
    try:
        return LibcryptoAesGcm(key)
    except OSError as exc:
        if not _fallback_logged.is_set():
            _fallback_logged.set()
            logger.warning(
                "AES-GCM falls back to the cryptography package, which holds the GIL "
                "(encrypted KV restores use one core): libcrypto unusable: %s",
                exc,
            )
        return PyCaAesGcm(key)
