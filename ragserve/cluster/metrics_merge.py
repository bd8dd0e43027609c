"""The cluster's ``/metrics``: the router's own counters, then every replica's metrics with
a ``replica`` label added, in one Prometheus text exposition.

NOTE: the replicas' families are merged by name, so a scraper sees one family per metric
with a sample per replica and can aggregate with ``sum by`` as usual.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families

from ragserve.cluster.router import DECISIONS, RouterStats


def _labels(labels: Mapping[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(
        '{}="{}"'.format(k, v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n"))
        for k, v in sorted(labels.items())
    )
    return "{" + inner + "}"


def _value(value: float) -> str:
    return repr(float(value)) if value == value else "NaN"


def router_lines(stats: RouterStats, in_flight: Sequence[int], up: Sequence[bool]) -> list[str]:
    lines = [
        "# HELP ragserve_router_decisions_total Routing decisions by kind",
        "# TYPE ragserve_router_decisions_total counter",
    ]
    for name in DECISIONS:
        lines.append(
            f"ragserve_router_decisions_total{_labels({'decision': name})} "
            f"{_value(stats.decisions[name])}"
        )
    families = (
        ("ragserve_router_requests_total", "counter", "Requests sent to each replica", None),
        ("ragserve_router_in_flight", "gauge", "Requests in flight on each replica", in_flight),
        ("ragserve_router_replica_up", "gauge", "1 while the replica answers", up),
    )
    for name, kind, doc, values in families:
        lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}"]
        for i in range(len(up)):
            value = stats.by_replica[i] if values is None else float(values[i])
            lines.append(f"{name}{_labels({'replica': str(i)})} {_value(value)}")
    return lines


def merged_replica_lines(texts: Mapping[int, str]) -> list[str]:
    """Every replica's exposition, one family per name, a ``replica`` label on each sample.
    A replica whose text does not parse is left out (its ``replica_up`` says why)."""
    kinds: dict[str, tuple[str, str]] = {}
    samples: dict[str, list[str]] = {}
    for index, text in sorted(texts.items()):
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError:
            continue
        for family in families:
            kinds.setdefault(family.name, (family.type, family.documentation))
            rows = samples.setdefault(family.name, [])
            for sample in family.samples:
                labels = {**sample.labels, "replica": str(index)}
                rows.append(f"{sample.name}{_labels(labels)} {_value(sample.value)}")
    lines: list[str] = []
    for name, rows in samples.items():
        kind, doc = kinds[name]
        # NOTE: the parser names a counter family without its samples' ``_total``; the
        # text format names it with it.
        shown = f"{name}_total" if kind == "counter" else name
        lines += [f"# HELP {shown} {doc}", f"# TYPE {shown} {kind}", *rows]
    return lines
