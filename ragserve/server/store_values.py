"""How a registry row and a tombstone are kept in the store (see
:mod:`ragserve.server.store_registry`), and the one script that writes them.

A value's first line is its stamp: ``ragserve-row-v2 <version>`` or ``ragserve-gone-v2
<version>``; a row's JSON head (:func:`~ragserve.server.registry_rows.encode_row`'s text
columns, checksum included) and its token column follow. The watch reads the stamps alone
(a few bytes a document), and the full row only of a document whose version moved.

The store gives the version when the write reaches it: ``max(previous + 1, its clock in
ms)``, so a row's versions only grow while the store keeps the row, and stay above the
earlier ones (its clock) when it lost the row meanwhile. Values of the first format
(``ragserve-row-v1``, ``ragserve-gone-v1``: no stamp line) read as version 0.

The version only orders rows: what is served is still what the checksum and the seal
vouch for, so a damaged or forged version can at most make a server take a genuine row
again, or not take it.
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

from ragserve.server.registry_rows import Row, RowError

_ROW_V1 = b"ragserve-row-v1\n"
_GONE_V1 = b"ragserve-gone-v1\n"
_STAMP = re.compile(rb"ragserve-(row|gone)-v2 (\d{1,18})\n")
# NOTE: enough for the longest stamp line, so the watch never reads a row's body.
STAMP_BYTES = 40

# Modes of ``WRITE``: ``row`` (an upload: replaces a tombstone), ``patch`` (a PATCH or a
# retried write: never replaces a tombstone), ``offer`` (a row the store lost: written at
# the version this server holds, only where the store holds no tombstone and no newer
# row), ``gone`` (a tombstone that expires after ARGV[5] seconds), ``expire`` (a
# tombstone, unless the store holds a newer version than ARGV[4], the expired row read).
# KEYS: the row, the ids set; ARGV: mode, body, id, version, tombstone ttl.
# Returns the version written, -1 when nothing was.
WRITE = """
local old = redis.call('GET', KEYS[1])
local seen, gone = -1, false
if old then
  local kind, stamp = string.match(old, '^ragserve%-(%a+)%-v2 (%d+)\\n')
  if kind then
    seen, gone = tonumber(stamp), kind == 'gone'
  else
    seen, gone = 0, string.sub(old, 1, 17) == 'ragserve-gone-v1\\n'
  end
end
local mode = ARGV[1]
local version = tonumber(ARGV[4])
if mode == 'offer' then
  if old and (gone or seen >= version) then return -1 end
elseif (mode == 'patch' and gone) or (mode == 'expire' and seen > version) then
  return -1
else
  local now = redis.call('TIME')
  version = math.max(seen + 1, tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000))
end
local stamp = string.format('%d', version)
if mode == 'gone' or mode == 'expire' then
  redis.call('SET', KEYS[1], 'ragserve-gone-v2 ' .. stamp .. '\\n', 'EX', ARGV[5])
  redis.call('SREM', KEYS[2], ARGV[3])
else
  redis.call('SET', KEYS[1], 'ragserve-row-v2 ' .. stamp .. '\\n' .. ARGV[2])
  redis.call('SADD', KEYS[2], ARGV[3])
end
return version
"""


class Stamp(NamedTuple):
    version: int
    gone: bool


def stamp_of(value: bytes) -> Stamp | None:
    """The stamp a value (or its first ``STAMP_BYTES``) starts with; None for a value
    that is neither a row nor a tombstone."""
    if value.startswith(_ROW_V1):
        return Stamp(0, False)
    if value.startswith(_GONE_V1):
        return Stamp(0, True)
    match = _STAMP.match(value)
    if match is None:
        return None
    return Stamp(int(match[2]), match[1] == b"gone")


def row_body(row: Row) -> bytes:
    """What follows a row's stamp line: a JSON head of :func:`encode_row`'s text columns,
    a newline, then the token column's bytes."""
    model, namespace, doc_id, blob, metadata, created, expire, digest = row
    head = json.dumps([model, namespace, doc_id, metadata, created, expire, digest])
    return head.encode() + b"\n" + bytes(blob)


def unpack_row(value: bytes) -> Row:
    """A row value as ``decode_row`` reads it (``row`` column 0). Raises RowError."""
    stamp = stamp_of(value)
    if stamp is None or stamp.gone:
        raise RowError("not a registry row")
    head, sep, blob = value.partition(b"\n")[2].partition(b"\n")
    try:
        fields = json.loads(head) if sep else None
    except ValueError:
        fields = None
    if not isinstance(fields, list) or len(fields) != 7:
        raise RowError("malformed row head")
    model, namespace, doc_id, metadata, created, expire, digest = fields
    if isinstance(expire, int) and not isinstance(expire, bool):
        expire = float(expire)  # NOTE: JSON writes 5.0 as 5.0, but be lenient with ints
    return (0, model, namespace, doc_id, blob, metadata, created, expire, digest)
