"""Whole records in memory: encode one for a store that takes values, not files, and
verify one into its destination. Same format and checks as the disk tier's files
(``record_format``), so a value is trusted only after its header checksum, salt, block
hash, token ids (or keyed token digest), layout and payload checksum (or GCM tag) match.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvstore.record_cipher import SEAL_OVERHEAD, CipherError, RecordCipher, identity_bytes
from kvstore.record_format import (
    PREFIX,
    RecordError,
    decode_head,
    encode_head,
    seal_record,
    tensor_bytes,
    verify_header,
    verify_payload,
)
from kvstore.tier import BlockLike, block_nbytes


def encode_value(meta: BlockLike, block: torch.Tensor, cipher: RecordCipher | None = None) -> bytes:
    """The record of ``block`` (a contiguous CPU tensor) as one byte string."""
    payload = tensor_bytes(block)
    if cipher is None:
        return encode_head(meta, block.dtype, block.shape, payload) + payload
    head, sealed = seal_record(meta, block.dtype, block.shape, payload, cipher)
    return head + sealed


def decode_value_into(
    value: bytes | bytearray | memoryview,
    meta: BlockLike,
    dtype: torch.dtype,
    shape: Sequence[int],
    dest: torch.Tensor,
    cipher: RecordCipher | None = None,
) -> None:
    """Verify the record ``value`` against ``meta`` and copy its block into ``dest``.

    Raises ``RecordError`` (kind: corrupt | foreign | mismatch) and then leaves ``dest``
    untouched: nothing is copied before every check has passed.
    """
    view = memoryview(value)
    payload_len = block_nbytes(shape, dtype) + (0 if cipher is None else SEAL_OVERHEAD)
    head_len = len(view) - payload_len
    if head_len < PREFIX.size:
        raise RecordError("corrupt", f"a value of {len(view)} bytes cannot hold this block")
    header = decode_head(view[:head_len])
    verify_header(header, meta, dtype, shape, cipher)
    payload = view[head_len:]
    if cipher is None:
        verify_payload(header, payload)
        _copy_bytes(payload, dest, dtype, shape)
        return
    if header.payload_len != len(payload):
        raise RecordError("corrupt", f"payload length {len(payload)} != {header.payload_len}")
    plain = torch.empty(tuple(shape), dtype=dtype)
    identity = identity_bytes(meta.block_hash, meta.parent_hash, meta.salt)
    try:
        cipher.open_into(meta.salt, identity, payload, tensor_bytes(plain))
    except CipherError as exc:
        raise RecordError("foreign", str(exc)) from None
    dest.copy_(plain)


def _copy_bytes(
    payload: memoryview, dest: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]
) -> None:
    if dest.device.type == "cpu" and dest.is_contiguous():
        tensor_bytes(dest)[:] = payload  # NOTE: one memcpy, no tensor built around it
        return
    # NOTE: through a host tensor: the value's bytes are immutable, and a GPU copy needs
    # a tensor to read from.
    staged = torch.empty(tuple(shape), dtype=dtype)
    tensor_bytes(staged)[:] = payload
    dest.copy_(staged)
