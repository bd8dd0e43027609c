"""The two-tenant fairness run of ``ragserve bench serve`` (``--fairness``).

One ``ragserve serve`` with two API keys, the server's default admission and per-tenant
limits. Each tenant uploads the same document (tenants share nothing, so each prefills
its own copy). First the quiet tenant alone: ``FAIRNESS_ALONE`` questions one after the
other, its baseline TTFT. Then both at once for ``--fairness-seconds``: open-loop Poisson
arrivals of streamed questions, the quiet tenant at ``--fairness-rate`` requests/s and
the flooding one at ``--fairness-ratio`` times that. Per tenant: requests sent, admitted
(answered in full), refused (429: the tenant's own limits; 503: the server's capacity),
failed, the admitted share (admitted / sent) and TTFT p50/p99 of the admitted ones.

Fair service shows as the quiet tenant keeping its admitted share near 1 and its TTFT
near its baseline while the flooding tenant, past what the server can take, is refused
or waits.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from ragserve.bench.serve_client import (
    RequestResult,
    chat_body,
    document_text,
    percentile,
    question,
    stream_chat,
    upload_document,
    wait_healthy,
)
from ragserve.cli import CliError
from ragserve.config import EngineConfig
from ragserve.config_flags import to_argv
from ragserve.server.process import ServerProcess, ServerStartError
from ragserve.table import print_table

HOST = "127.0.0.1"
QUIET, FLOOD = "quiet", "flood"
KEYS = {QUIET: "bench-quiet-tenant", FLOOD: "bench-flood-tenant"}
FAIRNESS_ALONE = 8  # the quiet tenant's baseline questions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("two-tenant fairness run")
    group.add_argument(
        "--fairness", action="store_true", help="also run the two-tenant fairness run"
    )
    group.add_argument(
        "--fairness-only", action="store_true", help="run only the two-tenant fairness run"
    )
    group.add_argument(
        "--fairness-seconds", type=float, default=60.0, help="length of the two-tenant phase"
    )
    group.add_argument(
        "--fairness-rate", type=float, default=0.2, help="the quiet tenant's requests/s"
    )
    group.add_argument(
        "--fairness-ratio", type=float, default=10.0, help="the flooding tenant's rate multiple"
    )


def validate(args: argparse.Namespace) -> None:
    bounds = {
        "--fairness-seconds": (args.fairness_seconds, 1.0, 3600.0),
        "--fairness-rate": (args.fairness_rate, 0.001, 100.0),
        "--fairness-ratio": (args.fairness_ratio, 1.0, 1000.0),
    }
    for flag, (value, low, high) in bounds.items():
        if not low <= value <= high:
            raise ValueError(f"{flag} must be in [{low}, {high}], got {value}")


@dataclass
class TenantRun:
    """One tenant's requests of one phase."""

    tenant: str
    phase: str
    rate: float | None  # requests/s offered; None: one after the other
    results: list[RequestResult] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        admitted = [r for r in self.results if r.error is None]
        ttfts = [r.ttft_s for r in admitted if r.ttft_s is not None]
        refused = {status: sum(r.status == status for r in self.results) for status in (429, 503)}
        sent = len(self.results)
        return {
            "tenant": self.tenant,
            "phase": self.phase,
            "rate_per_s": self.rate,
            "sent": sent,
            "admitted": len(admitted),
            "refused_429": refused[429],
            "refused_503": refused[503],
            "failed": sent - len(admitted) - refused[429] - refused[503],
            "admitted_share": len(admitted) / sent if sent else None,
            "ttft_p50_s": percentile(ttfts, 0.50) if ttfts else None,
            "ttft_p99_s": percentile(ttfts, 0.99) if ttfts else None,
            "errors": sorted(
                {
                    r.error
                    for r in self.results
                    if r.error is not None and r.status not in (429, 503)
                }
            )[:5],
            "refusals": sorted(
                {r.error[:200] for r in self.results if r.error and r.status in (429, 503)}
            )[:3],
        }


async def open_loop(
    session: aiohttp.ClientSession,
    url: str,
    bodies: list[dict[str, Any]],
    rate: float,
    seconds: float,
    rng: random.Random,
) -> list[RequestResult]:
    """Send ``bodies`` in order at Poisson arrivals of ``rate``/s for ``seconds`` (each in
    its own task, whatever the answers' pace); returns the results in sending order."""
    started = time.perf_counter()
    offset = 0.0
    tasks: list[asyncio.Task[RequestResult]] = []
    for body in bodies:
        offset += rng.expovariate(rate)
        if offset > seconds:
            break
        await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
        tasks.append(asyncio.create_task(stream_chat(session, url, body)))
    return list(await asyncio.gather(*tasks))


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Both phases against the server at ``url``; returns the document and the tenant runs."""
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    sessions = {
        tenant: aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=timeout,
            headers={"Authorization": f"Bearer {key}"},
        )
        for tenant, key in KEYS.items()
    }
    try:
        quiet, flood = sessions[QUIET], sessions[FLOOD]
        await wait_healthy(quiet, url, args.server_timeout)
        text = document_text(args.doc_tokens)
        docs = {
            tenant: await upload_document(session, url, text, args.request_timeout)
            for tenant, session in sessions.items()
        }

        def bodies(tenant: str, first: int, count: int) -> list[dict[str, Any]]:
            doc_id = docs[tenant]["id"]
            return [
                chat_body(doc_id, question(first + n), args.max_tokens, stream=True)
                for n in range(count)
            ]

        alone = TenantRun(QUIET, "alone", None)
        for body in bodies(QUIET, 0, FAIRNESS_ALONE):
            alone.results.append(await stream_chat(quiet, url, body))
        rates = {QUIET: args.fairness_rate, FLOOD: args.fairness_rate * args.fairness_ratio}
        runs = {tenant: TenantRun(tenant, "together", rate) for tenant, rate in rates.items()}
        # NOTE: enough bodies for the longest plausible run of arrivals at each rate.
        counts = {
            tenant: int(rate * args.fairness_seconds * 3) + 10 for tenant, rate in rates.items()
        }
        quiet_results, flood_results = await asyncio.gather(
            open_loop(quiet, url, bodies(QUIET, 1000, counts[QUIET]), rates[QUIET],
                      args.fairness_seconds, random.Random(1)),
            open_loop(flood, url, bodies(FLOOD, 100_000, counts[FLOOD]), rates[FLOOD],
                      args.fairness_seconds, random.Random(2)),
        )  # fmt: skip
        runs[QUIET].results, runs[FLOOD].results = quiet_results, flood_results
        return {"document": docs[QUIET], "runs": [alone, runs[QUIET], runs[FLOOD]]}
    finally:
        for session in sessions.values():
            await session.close()


def run_fairness(
    args: argparse.Namespace, config: EngineConfig, env: dict[str, str], out: Path
) -> dict[str, Any]:
    """Start the two-key server, run both phases, stop it; print the table and return the
    JSON section. Raises CliError when the server does not start."""
    log_path = out.with_suffix(".fairness.server.log")
    flags = [*to_argv(config), *(arg for key in KEYS.values() for arg in ("--api-key", key))]
    server = ServerProcess(
        flags, log_path, host=HOST, log_level="INFO", env=env, start_timeout=args.server_timeout
    )
    try:
        server.start()
    except ServerStartError as exc:
        raise CliError(str(exc)) from None
    try:
        measured = asyncio.run(measure(server.url, args))
    finally:
        server.stop()
    summaries = [run.summary() for run in measured["runs"]]
    report(args, measured["document"], summaries)
    return {
        "server_command": server.command,
        "server_log": str(log_path),
        "document_tokens": measured["document"]["tokens"],
        "seconds": args.fairness_seconds,
        "tenants": summaries,
    }


def report(
    args: argparse.Namespace, document: dict[str, Any], tenants: list[dict[str, Any]]
) -> None:
    def ms(value: float | None) -> float | None:
        return None if value is None else value * 1000

    print_table(
        f"fairness: two tenants, each asking about its own {document['tokens']}-token document "
        f"({args.max_tokens} new tokens per answer); the flooding tenant at "
        f"{args.fairness_ratio:g}x the quiet one's rate for {args.fairness_seconds:g} s",
        ["tenant", "phase", "req/s", "sent", "admitted", "429", "503", "failed",
         "admitted share", "TTFT p50 ms", "TTFT p99 ms"],
        [
            [t["tenant"], t["phase"], t["rate_per_s"] or "one by one", t["sent"], t["admitted"],
             t["refused_429"], t["refused_503"], t["failed"], t["admitted_share"],
             ms(t["ttft_p50_s"]), ms(t["ttft_p99_s"])]
            for t in tenants
        ],
    )  # fmt: skip
    alone, together = tenants[0]["ttft_p50_s"], tenants[1]["ttft_p50_s"]
    if alone and together:
        print(f"\nthe quiet tenant's TTFT p50 with the flood / alone = {together / alone:.2f}x")
    for t in tenants:
        for error in t["errors"]:
            print(f"{t['tenant']} ({t['phase']}): {error}")
