"""On-disk record of one KV block: ``prefix | header | payload``, verified field by field.

- prefix: ``struct "<8sIQ"``: MAGIC, header length in bytes, xxh3_64 of the header bytes.
- header: a msgpack map: ``v`` format version, ``hash``, ``parent`` (bytes or nil),
  ``tokens`` (token ids), ``salt``, ``dtype`` (e.g. "bfloat16"), ``shape``, ``plen`` payload
  length, ``xxh`` xxh3_64 of the payload.
- payload: the block's raw bytes, C order, host byte order (little-endian on every
  supported host).
- encrypted records (see ``record_cipher``): ``tokens`` is empty and ``tdig`` holds a keyed
  digest of them, ``enc`` names the cipher, and the payload is the sealed bytes (``plen``
  and ``xxh`` describe those).

A reader knows the payload length from the expected dtype and shape, so one scatter read
of ``file_size - plen`` head bytes plus ``plen`` payload bytes fetches a whole record.
Every failure raises ``RecordError`` whose ``kind`` is the counter it belongs to.

Record files are written atomically (``write_record_file``): a unique temporary name in
the same directory, held under ``flock`` while written, fsync, rename, fsync the directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack
import torch
import xxhash

from kvstore.aes_gcm import NONCE_BYTES, TAG_BYTES
from kvstore.record_cipher import (
    CIPHER_NAME,
    SEAL_OVERHEAD,
    CipherError,
    RecordCipher,
    identity_bytes,
)
from kvstore.tier import HASH_BYTES, BlockLike, block_nbytes

MAGIC = b"RAGSKV\x00\x01"
FORMAT_VERSION = 1
PREFIX = struct.Struct("<8sIQ")
MAX_HEADER_BYTES = 1 << 20
RECORD_SUFFIX = ".kv"
# NOTE: records hold a tenant's token ids and KV: private to the server's user.
FILE_MODE = 0o600
DIR_MODE = 0o700
TEMP_SUFFIX = ".tmp"

RecordErrorKind = Literal["corrupt", "foreign", "mismatch"]


class RecordError(Exception):
    """A record that must not be served. ``kind``: corrupt | foreign | mismatch."""

    def __init__(self, kind: RecordErrorKind, reason: str) -> None:
        super().__init__(f"{kind} record: {reason}")
        self.kind: RecordErrorKind = kind
        self.reason = reason


@dataclass(frozen=True)
class RecordHeader:
    version: int
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    salt: bytes
    dtype: str
    shape: tuple[int, ...]
    payload_len: int
    payload_xxh3: int
    token_digest: bytes | None = None  # encrypted records: a keyed digest, no token ids


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes(block: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a flat memoryview, without copying."""
    if block.device.type != "cpu" or not block.is_contiguous():
        raise ValueError(
            f"need a contiguous CPU tensor, got device={block.device} "
            f"contiguous={block.is_contiguous()}"
        )
    # NOTE: view as uint8 first: numpy has no bfloat16, and the bytes are all we need.
    return block.reshape(-1).view(torch.uint8).numpy().data


def encode_head(
    meta: BlockLike,
    dtype: torch.dtype,
    shape: Sequence[int],
    payload: bytes | bytearray | memoryview,
    *,
    version: int = FORMAT_VERSION,
    token_digest: bytes | None = None,
) -> bytes:
    """Prefix plus header for ``payload``; the record is ``head + payload``.

    ``version`` exists to write records of other format versions (compatibility tests).
    ``token_digest``: an encrypted record's (``payload`` is then the sealed bytes).
    """
    fields: dict[str, Any] = {
        "v": version,
        "hash": meta.block_hash,
        "parent": meta.parent_hash,
        "tokens": list(meta.token_ids) if token_digest is None else [],
        "salt": meta.salt,
        "dtype": dtype_name(dtype),
        "shape": [int(dim) for dim in shape],
        "plen": len(payload),
        "xxh": xxhash.xxh3_64_intdigest(payload),
    }
    if token_digest is not None:
        fields.update(tdig=token_digest, enc=CIPHER_NAME)
    header = msgpack.packb(fields, use_bin_type=True)
    return PREFIX.pack(MAGIC, len(header), xxhash.xxh3_64_intdigest(header)) + header


def seal_record(
    meta: BlockLike,
    dtype: torch.dtype,
    shape: Sequence[int],
    payload: bytes | memoryview,
    cipher: RecordCipher,
) -> tuple[bytes, bytearray]:
    """(head, sealed payload) of an encrypted record; the file is ``head + sealed``."""
    sealed = cipher.seal(
        meta.salt, identity_bytes(meta.block_hash, meta.parent_hash, meta.salt), payload
    )
    digest = cipher.token_digest(meta.salt, meta.token_ids)
    return encode_head(meta, dtype, shape, sealed, token_digest=digest), sealed


def encode_record(meta: BlockLike, block: torch.Tensor) -> bytes:
    """One complete record for a CPU block (copies the payload; writers use encode_head)."""
    block = block.contiguous()
    payload = tensor_bytes(block)
    return encode_head(meta, block.dtype, block.shape, payload) + payload.tobytes()


def decode_head(region: bytes | bytearray | memoryview) -> RecordHeader:
    """Decode the head region (everything before the payload), checking its integrity."""
    if len(region) < PREFIX.size:
        raise RecordError("corrupt", f"head of {len(region)} bytes is shorter than the prefix")
    magic, header_len, header_xxh3 = PREFIX.unpack_from(region, 0)
    if magic != MAGIC:
        raise RecordError("corrupt", f"bad magic {bytes(magic)!r}")
    if header_len != len(region) - PREFIX.size or header_len > MAX_HEADER_BYTES:
        raise RecordError(
            "corrupt",
            f"header length {header_len} does not match the {len(region) - PREFIX.size} "
            "bytes before the payload (truncated or resized file)",
        )
    header = memoryview(region)[PREFIX.size :]
    if xxhash.xxh3_64_intdigest(header) != header_xxh3:
        raise RecordError("corrupt", "header checksum mismatch")
    try:
        fields = msgpack.unpackb(header, raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise RecordError("corrupt", f"undecodable header: {exc}") from exc
    if not isinstance(fields, dict):
        raise RecordError("corrupt", f"header is a {type(fields).__name__}, not a map")
    version = fields.get("v")
    if version != FORMAT_VERSION:
        raise RecordError("foreign", f"format version {version!r}, expected {FORMAT_VERSION}")
    try:
        return _typed_header(fields)
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordError("corrupt", f"malformed header field: {exc!r}") from exc


def _typed_header(fields: dict[str, Any]) -> RecordHeader:
    def as_bytes(value: Any, name: str) -> bytes:
        if not isinstance(value, bytes):
            raise TypeError(f"{name} is {type(value).__name__}, not bytes")
        return value

    def as_ints(value: Any, name: str) -> tuple[int, ...]:
        if not isinstance(value, list) or not all(type(item) is int for item in value):
            raise TypeError(f"{name} is not a list of ints")
        return tuple(value)

    block_hash = as_bytes(fields["hash"], "hash")
    parent = fields["parent"]
    if len(block_hash) != HASH_BYTES:
        raise ValueError(f"hash has {len(block_hash)} bytes")
    dtype = fields["dtype"]
    payload_len, payload_xxh3 = fields["plen"], fields["xxh"]
    if not isinstance(dtype, str) or type(payload_len) is not int or type(payload_xxh3) is not int:
        raise TypeError("dtype, plen or xxh has the wrong type")
    digest = fields.get("tdig")
    return RecordHeader(
        token_digest=None if digest is None else as_bytes(digest, "tdig"),
        version=fields["v"],
        block_hash=block_hash,
        parent_hash=None if parent is None else as_bytes(parent, "parent"),
        token_ids=as_ints(fields["tokens"], "tokens"),
        salt=as_bytes(fields["salt"], "salt"),
        dtype=dtype,
        shape=as_ints(fields["shape"], "shape"),
        payload_len=payload_len,
        payload_xxh3=payload_xxh3,
    )


def verify_header(
    header: RecordHeader,
    meta: BlockLike,
    dtype: torch.dtype,
    shape: Sequence[int],
    cipher: RecordCipher | None = None,
) -> None:
    """Check that the record is the block ``meta`` names, in the expected layout.

    With ``cipher`` only encrypted records pass (their token digest under this key must
    match); without, only plain ones."""
    if header.salt != meta.salt:
        raise RecordError("foreign", "salt (model fingerprint / tenant) differs")
    if header.block_hash != meta.block_hash:
        raise RecordError("mismatch", f"hash {header.block_hash.hex()} != {meta.block_hash.hex()}")
    if (header.token_digest is None) != (cipher is None):
        raise RecordError(
            "foreign", "encrypted record without the key, or plain with encryption on"
        )
    if cipher is not None:
        if header.token_digest != cipher.token_digest(meta.salt, meta.token_ids):
            raise RecordError("foreign", "token digest differs (another key, or other tokens)")
    elif header.token_ids != tuple(meta.token_ids):
        raise RecordError("mismatch", "token ids differ")
    if header.parent_hash != meta.parent_hash:
        raise RecordError("mismatch", "parent hash differs")
    expected_shape = tuple(int(dim) for dim in shape)
    if header.dtype != dtype_name(dtype) or header.shape != expected_shape:
        raise RecordError(
            "mismatch",
            f"layout {header.dtype}{list(header.shape)} != "
            f"{dtype_name(dtype)}{list(expected_shape)}",
        )


def verify_payload(header: RecordHeader, payload: bytes | memoryview) -> None:
    if header.payload_len != len(payload):
        raise RecordError(
            "corrupt", f"payload length {len(payload)} != header's {header.payload_len}"
        )
    if xxhash.xxh3_64_intdigest(payload) != header.payload_xxh3:
        raise RecordError("corrupt", "payload checksum mismatch")


def decode_record(
    data: bytes | bytearray | memoryview, meta: BlockLike, dtype: torch.dtype, shape: Sequence[int]
) -> memoryview:
    """Verify a whole in-memory record against ``meta``; return its payload bytes."""
    payload_len = block_nbytes(shape, dtype)
    view = memoryview(data)
    if len(view) < payload_len:
        raise RecordError("corrupt", f"record of {len(view)} bytes < payload {payload_len}")
    header = decode_head(view[: len(view) - payload_len])
    verify_header(header, meta, dtype, shape)
    payload = view[len(view) - payload_len :]
    verify_payload(header, payload)
    return payload


def read_record_into(
    fd: int,
    size: int,
    meta: BlockLike,
    dtype: torch.dtype,
    shape: Sequence[int],
    target: torch.Tensor,
    cipher: RecordCipher | None = None,
) -> None:
    """Read and verify the record of ``size`` bytes open as ``fd``.

    One scatter read puts the head in a small buffer and the payload straight into
    ``target`` (a contiguous CPU tensor of ``dtype`` and ``shape``), then everything is
    verified. On ``RecordError`` the contents of ``target`` are unspecified. With
    ``cipher`` the sealed payload is read into ``target`` and opened there.
    """
    if cipher is not None:
        _read_sealed_into(fd, size, meta, dtype, shape, target, cipher)
        return
    head_len = size - block_nbytes(shape, dtype)
    if not PREFIX.size <= head_len <= PREFIX.size + MAX_HEADER_BYTES:
        raise RecordError("corrupt", f"a file of {size} bytes cannot hold this block")
    head = bytearray(head_len)
    payload = tensor_bytes(target)
    got = os.preadv(fd, [head, payload], 0)
    if got != size:
        raise RecordError("corrupt", f"short read: {got} of {size} bytes")
    header = decode_head(head)
    verify_header(header, meta, dtype, shape)
    verify_payload(header, payload)


def _read_sealed_into(
    fd: int,
    size: int,
    meta: BlockLike,
    dtype: torch.dtype,
    shape: Sequence[int],
    target: torch.Tensor,
    cipher: RecordCipher,
) -> None:
    """One scatter read puts the nonce and tag aside and the ciphertext straight into
    ``target``, which is then decrypted in place (zeroed when it does not authenticate).

    NOTE: no scratch buffer: a copy less per block, and no thread-sized buffers that
    push the blocks being restored out of the cache."""
    sealed_len = block_nbytes(shape, dtype) + SEAL_OVERHEAD
    head_len = size - sealed_len
    if not PREFIX.size <= head_len <= PREFIX.size + MAX_HEADER_BYTES:
        raise RecordError("corrupt", f"a file of {size} bytes cannot hold this sealed block")
    head, nonce, tag = bytearray(head_len), bytearray(NONCE_BYTES), bytearray(TAG_BYTES)
    payload = tensor_bytes(target)
    got = os.preadv(fd, [head, nonce, payload, tag], 0)
    if got != size:
        raise RecordError("corrupt", f"short read: {got} of {size} bytes")
    header = decode_head(head)
    verify_header(header, meta, dtype, shape, cipher)
    if header.payload_len != sealed_len:
        raise RecordError(
            "corrupt", f"payload length {sealed_len} != header's {header.payload_len}"
        )
    # NOTE: the GCM tag authenticates every sealed byte, so the payload's xxh3 (still
    # written, for tools) is not computed again on this path.
    identity = identity_bytes(meta.block_hash, meta.parent_hash, meta.salt)
    try:
        cipher.open_in_place(meta.salt, identity, bytes(nonce), payload, bytes(tag))
    except CipherError as exc:
        raise RecordError("foreign", str(exc)) from None


def write_record_file(
    directory: str, name: str, head: bytes, payload: memoryview, *, fsync: bool = True
) -> None:
    """Create ``<directory>/<name>.kv`` atomically; no partial file ever has that name."""
    temp = os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    try:
        # NOTE: the lock tells a starting process that this temp file is alive.
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for part in (memoryview(head), payload):
            while part:
                part = part[os.write(fd, part) :]
        if fsync:
            os.fsync(fd)
        os.replace(temp, os.path.join(directory, name + RECORD_SUFFIX))
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    os.close(fd)
    if fsync:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def read_head_file(path: str) -> RecordHeader:
    """The verified header of the record file at ``path`` (the payload is not read).

    Raises RecordError for a damaged head, OSError when the file cannot be read."""
    with open(path, "rb") as handle:
        prefix = handle.read(PREFIX.size)
        if len(prefix) < PREFIX.size:
            raise RecordError("corrupt", "file shorter than the prefix")
        header_len = PREFIX.unpack_from(prefix, 0)[1]
        if header_len > MAX_HEADER_BYTES:
            raise RecordError("corrupt", f"header length {header_len} is too large")
        return decode_head(prefix + handle.read(header_len))


def remove_abandoned_temp(path: str) -> bool:
    """Remove a temporary record file unless a live writer still holds its lock.

    NOTE: a writer that has created its file but not yet locked it can lose it here; its
    rename then fails and the write counts as an error, never as a record.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # a writer (this or another process) is still writing it
    finally:
        os.close(fd)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
