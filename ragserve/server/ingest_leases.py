"""Who runs a document's ingestion, for the registry shared through the store (see
:mod:`ragserve.server.store_registry`): a lease beside the document's row. (A registry
directory shared without a store keeps the same lease in a table, see
:mod:`ragserve.server.registry_ingestions`.)

The upload's write of the ``ingesting`` row takes the lease with it (``WRITE``'s ``row``
mode, see :mod:`ragserve.server.store_values`), and the server ingesting the document
renews it at each watch round while its ingestion runs (``--ingest-lease-seconds``, a few
rounds). A server that dies mid-ingestion (``kill -9``, a lost machine) renews it no more:
it lapses, and a server that learned the document, seeing its row still ``ingesting``,
claims the lease (``CLAIM``: one server wins), runs the ingestion itself and settles the
row as its owner would have. Nothing ends a lease: it lapses when its ingestion no longer
renews it, and a claim needs a row that says ``ingesting``.

NOTE: a lease only keeps the other servers from starting a second ingestion while the
first runs; two may still run (the owner restarts and re-ingests from its own registry,
or the store restarted empty and lost the lease while the owner lives, or a round came
too late to renew). That is harmless: the KV they compute is content-hashed, so the same
blocks, and a settle only moves a row's status forward.
"""

from __future__ import annotations

from ragserve.server.store_values import STAMP_BYTES


def lease_key(row_key: str) -> str:
    """The key of the ingestion lease beside the row of ``row_key``."""
    return f"{row_key}:lease"


# Take the lease where the row is a current one that says ``ingesting`` and nobody holds
# the lease. KEYS: the row, its lease; ARGV: the lease's length in ms.
# Returns 1 when this call took it, else 0.
CLAIM = f"""
local head = redis.call('GETRANGE', KEYS[1], 0, {STAMP_BYTES - 1})
if not string.match(head, '^ragserve%-row%-v2 %d+\\ningesting[ \\n]') then return 0 end
if redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[1]) then return 1 end
return 0
"""
