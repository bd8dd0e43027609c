"""How a registry row and a tombstone are kept in the store (see
:mod:`ragserve.server.store_registry`), and the one script that writes them.

A value's first line is its stamp: ``ragserve-row-v2 <version>`` or ``ragserve-gone-v2
<version>``. A row's status line follows: how far its ingestion got, ``ingesting``,
``ready`` or ``failed <the error as a JSON string>``; then its JSON head
(:func:`~ragserve.server.registry_rows.encode_row`'s text columns, checksum included) and
its token column. The watch reads the stamps and statuses alone (a few bytes a document),
and the full row only of a document whose version moved.

The server that uploads a document publishes its row ``ingesting`` and settles it
(``ready`` or ``failed``: ``WRITE``'s ``settle``) when its ingestion ends; a server that
learned the document shows the status of the row it holds. A server that stops before it
settles leaves a row ``ingesting`` beside a lapsed lease: a server that learned the
document then runs the ingestion and settles the row (see
:mod:`ragserve.server.ingest_leases`). A row of an older server has
no status line (its head follows the stamp) and reads as ``ready``: such a server never
settles its rows, so ``ingesting`` would never end (and questions on a document never wait
for its ingestion). The status line is in the clear and outside the checksum, so the
script can read it: a forged one can make a document show as ingesting or failed, never
serve other tokens.

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
from typing import NamedTuple, cast

from ragserve.server.registry_rows import Row, RowError
from ragserve.server.stored_document import MAX_ERROR_CHARS, PROGRESS, Status

_ROW_V1 = b"ragserve-row-v1\n"
_GONE_V1 = b"ragserve-gone-v1\n"
_STAMP = re.compile(rb"ragserve-(row|gone)-v2 (\d{1,18})\n")
_STATUS_WORD = re.compile(rb"(ingesting|ready|failed)[ \n]")
# NOTE: enough for the longest stamp line and status word, so the watch never reads a
# row's body (nor a failed one's error).
STAMP_BYTES = 48

# Modes of ``WRITE``: ``row`` (an upload: replaces a tombstone), ``patch`` (a PATCH or a
# retried write: never replaces a tombstone), ``offer`` (a row the store lost: written at
# the version this server holds, only where the store holds no tombstone and no newer
# row), ``settle`` (the end of an ingestion: only over the row of version ARGV[4], the one
# this server holds, and only where its status says less than the new one), ``gone`` (a
# tombstone that expires after ARGV[5] seconds), ``expire`` (a tombstone, unless the store
# holds a newer version than ARGV[4], the expired row read). An upload's ``ingesting`` row
# takes its ingestion's lease for ARGV[6] ms (see :mod:`ragserve.server.ingest_leases`).
# KEYS: the row, the ids set, the lease; ARGV: mode, body, id, version, tombstone ttl,
# lease ms. Returns the version written, -1 when nothing was.
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
local function settles()
  if not old or gone or seen ~= version then return false end
  local progress = {ingesting = 0, failed = 1, ready = 2}
  -- NOTE: a row of an older server has no status line (its head starts with '['): ready
  local was = string.match(old, '^[^\\n]*\\n(%l+)[ \\n]') or 'ready'
  local to = string.match(ARGV[2], '^(%l+)[ \\n]')
  return (progress[was] or -1) < (progress[to] or -1)
end
if mode == 'offer' then
  if old and (gone or seen >= version) then return -1 end
elseif (mode == 'patch' and gone) or (mode == 'expire' and seen > version)
    or (mode == 'settle' and not settles()) then
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
  if mode == 'row' and string.match(ARGV[2], '^ingesting[ \\n]') then
    redis.call('SET', KEYS[3], '1', 'PX', ARGV[6])
  end
end
return version
"""


# KEYS: the tenant's listing, then row keys; ARGV: their ids. Each id whose key holds a
# row (not a tombstone, nothing) rejoins the listing, checked and added in one step: an id
# deleted meanwhile is not put back.
RELIST = """
for i, id in ipairs(ARGV) do
  if string.sub(redis.call('GETRANGE', KEYS[i + 1], 0, 12), 1, 13) == 'ragserve-row-' then
    redis.call('SADD', KEYS[1], id)
  end
end
return 0
"""


class Stamp(NamedTuple):
    version: int
    gone: bool
    status: Status = "ready"  # a row's (see the module); a tombstone's means nothing


def stamp_of(value: bytes) -> Stamp | None:
    """The stamp a value (or its first ``STAMP_BYTES``) starts with, with a row's status;
    None for a value that is neither a row nor a tombstone."""
    if value.startswith(_ROW_V1):
        return Stamp(0, False)
    if value.startswith(_GONE_V1):
        return Stamp(0, True)
    match = _STAMP.match(value)
    if match is None:
        return None
    word = _STATUS_WORD.match(value, match.end())
    status = cast(Status, word[1].decode()) if word is not None else "ready"
    return Stamp(int(match[2]), match[1] == b"gone", status)


def row_body(row: Row, status: Status, error: str | None = None) -> bytes:
    """What follows a row's stamp line: its status line, a JSON head of
    :func:`encode_row`'s text columns, a newline, then the token column's bytes."""
    model, namespace, doc_id, blob, metadata, created, expire, digest = row
    line = status if error is None else f"{status} {json.dumps(error[:MAX_ERROR_CHARS])}"
    head = json.dumps([model, namespace, doc_id, metadata, created, expire, digest])
    return line.encode() + b"\n" + head.encode() + b"\n" + bytes(blob)


def _split(value: bytes) -> tuple[bytes | None, bytes]:
    """A row value's status line (None: an older server's row has none) and what follows."""
    rest = value.partition(b"\n")[2]
    if rest.startswith(b"["):  # NOTE: a JSON head: an older server's row
        return None, rest
    line, _, rest = rest.partition(b"\n")
    return line, rest


def row_status(value: bytes) -> tuple[Status, str | None]:
    """A row value's status and error (see the module). Raises RowError."""
    line, _ = _split(value)
    if line is None:
        return "ready", None
    word, sep, error = line.partition(b" ")
    status = word.decode(errors="replace")
    if status not in PROGRESS:
        raise RowError("malformed status line")
    if not sep:
        return cast(Status, status), None
    try:
        text = json.loads(error)
    except ValueError:
        text = None
    if not isinstance(text, str):
        raise RowError("malformed error in the status line")
    return cast(Status, status), text[:MAX_ERROR_CHARS]


def unpack_row(value: bytes) -> Row:
    """A row value as ``decode_row`` reads it (``row`` column 0). Raises RowError."""
    stamp = stamp_of(value)
    if stamp is None or stamp.gone:
        raise RowError("not a registry row")
    head, sep, blob = _split(value)[1].partition(b"\n")
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
