"""How a cluster's replicas share documents, read from their flags (no Ray needed)."""

from __future__ import annotations

import pytest

from ragserve.cluster.settings import ClusterSettings, document_sharing


def test_the_store_alone_shares_documents_across_machines() -> None:
    store = ("--kv-remote-url", "redis://store:6379/0")
    assert document_sharing(store) == "store"
    assert document_sharing((*store, "--registry-dir", "/shared/registry")) == "store"
    assert document_sharing(("--registry-dir", "/shared/registry")) == "directory"
    assert document_sharing(("--kv-cpu-gib", "1")) is None


@pytest.mark.parametrize(
    "field",
    [{"replica_threads": 0}, {"replica_cpus": -1.0}, {"replica_cpus": float("nan")},
     {"start_timeout_s": 0.0}],
)  # fmt: skip
def test_settings_no_replica_could_start_with_are_refused(field: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(field))):
        ClusterSettings(**field)  # type: ignore[arg-type]
