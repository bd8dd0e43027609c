"""How a cluster's replicas share documents, read from their flags (no Ray needed)."""

from __future__ import annotations

from ragserve.cluster.settings import document_sharing


def test_the_store_alone_shares_documents_across_machines() -> None:
    store = ("--kv-remote-url", "redis://store:6379/0")
    assert document_sharing(store) == "store"
    assert document_sharing((*store, "--registry-dir", "/shared/registry")) == "store"
    assert document_sharing(("--registry-dir", "/shared/registry")) == "directory"
    assert document_sharing(("--kv-cpu-gib", "1")) is None
