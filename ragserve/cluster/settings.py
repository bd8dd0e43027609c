"""What a cluster is made of: the replica count, the routing policy and the flags every
replica's engine and server get (the same flags as ``ragserve serve``)."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ragserve.config import EngineConfig
from ragserve.server.config import ServerConfig

Policy = Literal["affinity", "round_robin"]
POLICIES: tuple[Policy, ...] = ("affinity", "round_robin")


@dataclass(frozen=True)
class ClusterSettings:
    """``serve_args``: the ``ragserve serve`` flags of every replica (``--host`` and
    ``--port`` are the replica's own listening address: see ``replica_host``).
    ``busy_threshold``: a replica with this many requests in flight through the ingress is
    busy, and a request for a document it holds goes to the least loaded replica instead
    when that one has fewer.
    ``replica_host``: where replicas listen (``0.0.0.0`` on several machines: each then
    advertises its node's address). ``replica_threads``: torch threads per replica (None:
    torch's default). ``start_timeout_s``: how long the first requests wait for a replica
    that has not told its address yet (still starting, or restarting) before they go to
    the others; it is looked for in the background after that. ``fan_out_timeout_s``: how
    long a replica may take to answer the calls the ingress makes to every replica (a
    metrics scrape, a job listing, the search for a job) before it is left out: one
    stalled replica must not hold up the cluster's answer."""

    replicas: int = 2
    policy: Policy = "affinity"
    busy_threshold: int = 4
    serve_args: tuple[str, ...] = ()
    replica_host: str = "127.0.0.1"
    replica_cpus: float = 1.0
    replica_threads: int | None = None
    forward_timeout_s: float = 600.0
    address_timeout_s: float = 5.0
    start_timeout_s: float = 60.0
    fan_out_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.busy_threshold < 1:
            raise ValueError(f"busy_threshold must be >= 1, got {self.busy_threshold}")
        if self.replica_threads is not None and self.replica_threads < 1:
            raise ValueError(f"replica_threads must be >= 1, got {self.replica_threads}")
        if not self.replica_cpus > 0:  # NOTE: NaN too
            raise ValueError(f"replica_cpus must be > 0, got {self.replica_cpus}")
        timeouts = (
            self.forward_timeout_s,
            self.address_timeout_s,
            self.start_timeout_s,
            self.fan_out_timeout_s,
        )
        if not min(timeouts) > 0:
            raise ValueError(
                "forward_timeout_s, address_timeout_s, start_timeout_s and fan_out_timeout_s "
                "must be > 0"
            )

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ClusterSettings:
        """From ``serve run``'s ``key=value`` arguments (all strings) or a dict;
        ``serve_args`` may be one shell-quoted string."""
        serve_args = values.get("serve_args", ())
        if isinstance(serve_args, str):
            serve_args = shlex.split(serve_args)
        threads = values.get("replica_threads")
        return cls(
            replicas=int(values.get("replicas", 2)),
            policy=values.get("policy", "affinity"),
            busy_threshold=int(values.get("busy_threshold", 4)),
            serve_args=tuple(serve_args),
            replica_host=str(values.get("replica_host", "127.0.0.1")),
            replica_cpus=float(values.get("replica_cpus", 1.0)),
            replica_threads=None if threads in (None, "") else int(threads),
            forward_timeout_s=float(values.get("forward_timeout_s", 600.0)),
            start_timeout_s=float(values.get("start_timeout_s", 60.0)),
            fan_out_timeout_s=float(values.get("fan_out_timeout_s", 5.0)),
        )


def replica_configs(
    serve_args: Sequence[str], host: str
) -> tuple[EngineConfig, ServerConfig, list[str]]:
    """The engine and server configs of one replica (listening on ``host``, a free port)
    and its API keys, from ``ragserve serve`` flags. Raises SystemExit on bad flags, as
    argparse does."""
    from ragserve.cli import add_engine_args, engine_config_from_args
    from ragserve.config_flags import add_flags, config_from_args
    from ragserve.server.auth import read_api_key_file

    parser = argparse.ArgumentParser(prog="ragserve-replica")
    add_flags(parser.add_argument_group("server"), ServerConfig)
    parser.add_argument("--api-key-file", default=None)
    add_engine_args(parser)
    args = parser.parse_args(list(serve_args))
    keys = list(args.api_keys)
    if args.api_key_file:
        keys += read_api_key_file(args.api_key_file)
    args.host, args.port = host, 0
    server = config_from_args(ServerConfig, args, api_keys=tuple(keys))
    return engine_config_from_args(args), server, keys


def document_sharing(serve_args: Sequence[str]) -> Literal["store", "directory"] | None:
    """How the replicas of ``serve_args`` share their documents: ``store`` with
    ``--kv-remote-url`` (rows published to the store: replicas on any machine, with or
    without ``--registry-dir``), ``directory`` with ``--registry-dir`` alone (one folder:
    one machine, or a filesystem all of them share), None when not at all."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--kv-remote-url", default=None)
    parser.add_argument("--registry-dir", default=None)
    known, _ = parser.parse_known_args(list(serve_args))
    if known.kv_remote_url:
        return "store"
    return "directory" if known.registry_dir else None


def report_keys(serve_args: Sequence[str]) -> frozenset[str]:
    """The keys that open the cluster's own reports (``/cluster/stats``, ``/metrics``): the
    replicas' metrics key, else their API keys. Empty: the replicas have no keys, nor do
    reports."""
    from ragserve.server.auth import read_api_key_file

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--api-key", action="append", default=[])
    parser.add_argument("--api-key-file", default=None)
    parser.add_argument("--metrics-key", default=None)
    known, _ = parser.parse_known_args(list(serve_args))
    if known.metrics_key:
        return frozenset({known.metrics_key})
    keys = set(known.api_key)
    if known.api_key_file:
        keys.update(read_api_key_file(known.api_key_file))
    return frozenset(keys)


def request_limit(serve_args: Sequence[str]) -> int:
    """The replicas' largest request body (``--max-request-bytes``): the ingress holds no
    more of one before it is refused."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--max-request-bytes", type=int, default=ServerConfig.max_request_bytes)
    known, _ = parser.parse_known_args(list(serve_args))
    return int(known.max_request_bytes)
