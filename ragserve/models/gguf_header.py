"""A fast reader of GGUF headers (metadata + tensor index) and zero-copy tensor views.

NOTE: ``gguf.GGUFReader`` builds a numpy memmap slice for every element of every metadata
array; for a 49k-token vocabulary that is about a million slices and 2 s per load. Here the
header is walked with ``struct`` over one memoryview (about 0.1 s), while tensor types,
sizes and dequantization still come from the ``gguf`` package. Tensor views have the
shapes ``GGUFReader`` gives them (torch order; quantized rows as raw bytes), which is what
``gguf.quants.dequantize`` expects.

Format (little-endian, versions 2 and 3): magic ``GGUF``, version u32, tensor count u64,
metadata count u64, metadata ``(key, type u32, value)``, tensor infos ``(name, n_dims u32,
dims u64[n_dims], type u32, offset u64)``, padding to ``general.alignment`` (default 32),
then tensor data. Strings are a u64 byte length followed by UTF-8 bytes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32

_SCALARS: dict[GGUFValueType, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_U32 = _SCALARS[GGUFValueType.UINT32]
_U64 = _SCALARS[GGUFValueType.UINT64]
# Element dtypes of unquantized tensor types (the rest are read as raw bytes).
_PLAIN_DTYPES: dict[GGMLQuantizationType, Any] = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (GGUF stores dims innermost first)
    offset: int  # absolute byte offset in the file
    n_bytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """Parsed header of one GGUF file; ``data`` maps the whole file read-only. Arrays of
    strings in ``metadata`` are :class:`StringArray` (decoded on access), other arrays lists."""

    path: Path
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]
    data_offset: int
    digest: str  # sha256 of the header bytes: metadata and tensor index
    data: np.ndarray

    def tensor_data(self, info: GGUFTensorInfo) -> np.ndarray:
        """A read-only view of ``info``'s data, shaped as ``gguf.quants.dequantize`` expects."""
        dtype = _PLAIN_DTYPES.get(info.tensor_type)
        raw = self.data[info.offset : info.offset + info.n_bytes]
        if dtype is not None:
            return raw.view(dtype).reshape(info.shape)
        return raw.reshape(quant_shape_to_byte_shape(info.shape, info.tensor_type))


class StringArray(Sequence[str]):
    """A metadata array of strings, decoded on access.

    NOTE: a vocabulary and its merges are about 100k strings that start-up never reads
    (the tokenizer is converted from the file by transformers, once): decoding them all
    cost 0.3 s of every start-up; finding where each one starts costs a tenth of that.
    """

    def __init__(self, buffer: memoryview, starts: list[int]) -> None:
        self._buffer = buffer
        self._starts = starts  # offset of each string's u64 length

    def __len__(self) -> int:
        return len(self._starts)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self._decode(start) for start in self._starts[index]]
        return self._decode(self._starts[index])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # mutable-looking like a list: not hashable

    def __repr__(self) -> str:
        return f"StringArray({len(self)} strings)"

    def _decode(self, start: int) -> str:
        (length,) = _U64.unpack_from(self._buffer, start)
        return str(self._buffer[start + _U64.size : start + _U64.size + length], "utf-8")


class _Cursor:
    def __init__(self, buffer: memoryview) -> None:
        self.buffer = buffer
        self.offset = 0

    def unpack(self, codec: struct.Struct) -> Any:
        (value,) = codec.unpack_from(self.buffer, self.offset)
        self.offset += codec.size
        return value

    def string(self) -> str:
        length = self.unpack(_U64)
        end = self.offset + length
        if end > len(self.buffer):
            raise struct.error(f"string of {length} bytes runs past the end of the file")
        text = str(self.buffer[self.offset : end], "utf-8")
        self.offset = end
        return text

    def string_array(self, count: int) -> StringArray:
        starts = []
        for _ in range(count):
            starts.append(self.offset)
            length = self.unpack(_U64)
            self.offset += length
        if self.offset > len(self.buffer):
            raise struct.error("a string array runs past the end of the file")
        return StringArray(self.buffer, starts)

    def value(self, value_type: GGUFValueType) -> Any:
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type == GGUFValueType.ARRAY:
            item_type = GGUFValueType(self.unpack(_U32))
            count = self.unpack(_U64)
            if item_type == GGUFValueType.STRING:
                return self.string_array(count)
            codec = _SCALARS.get(item_type)
            if codec is None:
                return [self.value(item_type) for _ in range(count)]
            items = np.frombuffer(self.buffer, codec.format, count, self.offset)
            self.offset += count * codec.size
            return items.tolist()
        return self.unpack(_SCALARS[value_type])


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse ``path``'s header; ValueError for a file that is not a complete GGUF v2/v3."""
    try:
        data = np.memmap(path, mode="r")
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read GGUF file {path}: {exc}") from exc
    buffer = data.data
    if bytes(buffer[:4]) != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file (magic {bytes(buffer[:4])!r})")
    cursor = _Cursor(buffer)
    cursor.offset = 4
    try:
        version = cursor.unpack(_U32)
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version {version} of {path} is not supported {_VERSIONS}")
        tensor_count, kv_count = cursor.unpack(_U64), cursor.unpack(_U64)
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cursor.string()
            metadata[key] = cursor.value(GGUFValueType(cursor.unpack(_U32)))
        index = [_tensor_entry(cursor) for _ in range(tensor_count)]
    except struct.error as exc:
        raise ValueError(f"truncated or corrupt GGUF header in {path}: {exc}") from exc
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"GGUF alignment {alignment} of {path} is not a power of two")
    data_offset = -(-cursor.offset // alignment) * alignment
    tensors = [_tensor_info(entry, data_offset) for entry in index]
    for info in tensors:
        if info.offset + info.n_bytes > len(data):
            raise ValueError(
                f"GGUF file {path} is truncated: tensor {info.name!r} ends at byte "
                f"{info.offset + info.n_bytes}, the file has {len(data)}"
            )
    digest = hashlib.sha256(buffer[:data_offset]).hexdigest()
    # NOTE: a plain ndarray view (it keeps the map alive) slices faster than np.memmap.
    return GGUFHeader(path, metadata, tensors, data_offset, digest, np.asarray(data))


def _tensor_entry(cursor: _Cursor) -> tuple[str, list[int], int, int]:
    name = cursor.string()
    dims = [cursor.unpack(_U64) for _ in range(cursor.unpack(_U32))]
    return name, dims, cursor.unpack(_U32), cursor.unpack(_U64)


def _tensor_info(entry: tuple[str, list[int], int, int], data_offset: int) -> GGUFTensorInfo:
    name, dims, raw_type, relative_offset = entry
    tensor_type = GGMLQuantizationType(raw_type)
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    n_elements = int(np.prod(dims)) if dims else 1
    return GGUFTensorInfo(
        name=name,
        tensor_type=tensor_type,
        shape=tuple(reversed(dims)),
        offset=data_offset + relative_offset,
        n_bytes=n_elements * type_size // block_size,
    )
