"""``ragserve bench serve``: document QA over HTTP against a real ``ragserve serve``."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import aiohttp

from ragserve.bench.common import print_table, write_json
from ragserve.cli import CliError
from ragserve.config import EngineConfig

T = TypeVar("T")

HOST = "127.0.0.1"
OVERHEAD_TARGET = 1.2
MAX_CONCURRENCY = 1024
MAX_REQUESTS_PER_LEVEL = 100_000
MIN_DOC_TOKENS = 32
# NOTE: measured with SmolLM2's tokenizer on ``document_text``; the size is approximate by
# design and the server reports the exact count on upload.
TOKENS_PER_LINE = 28
OVERHEAD_QUESTION = "In one word: is this document a maintenance manual?"
_SERVING = re.compile(r"ragserve serving .* at http://127\.0\.0\.1:(\d+)/v1")
_PARTS = ("bearing", "seal", "impeller", "shaft", "gasket", "rotor", "coupling", "sensor")
_PERIODS = ("days", "weeks", "months")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--concurrency", default="1,4,16,32", help="comma-separated client concurrency levels"
    )
    parser.add_argument("--requests-per-level", type=int, default=32)
    parser.add_argument("--doc-tokens", type=int, default=2000, help="approximate document size")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per answer")
    parser.add_argument("--overhead-repeats", type=int, default=20)
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    parser.add_argument("--server-timeout", type=float, default=300.0, help="seconds to start")
    parser.add_argument("--out", default="bench-results/serve.json")


def concurrency_levels(text: str) -> list[int]:
    """``"1,4,16"`` → ``[1, 4, 16]``; ValueError unless each is in [1, MAX_CONCURRENCY]."""
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(
            f"--concurrency must be integers separated by commas, got {text!r}"
        ) from None
    if not levels or any(not 1 <= level <= MAX_CONCURRENCY for level in levels):
        raise ValueError(f"--concurrency levels must be in [1, {MAX_CONCURRENCY}], got {text!r}")
    return levels


def validate(args: argparse.Namespace) -> list[int]:
    """Every run is bounded; returns the concurrency levels."""
    bounds = {
        "--requests-per-level": (args.requests_per_level, 1, MAX_REQUESTS_PER_LEVEL),
        "--doc-tokens": (args.doc_tokens, MIN_DOC_TOKENS, 10_000_000),
        "--max-tokens": (args.max_tokens, 1, 65_536),
        "--overhead-repeats": (args.overhead_repeats, 1, 10_000),
        "--request-timeout": (args.request_timeout, 1, 3600),
        "--server-timeout": (args.server_timeout, 1, 3600),
    }
    for flag, (value, low, high) in bounds.items():
        if not low <= value <= high:
            raise ValueError(f"{flag} must be in [{low}, {high}], got {value}")
    return concurrency_levels(args.concurrency)


# -- workload ------------------------------------------------------------------------------
def document_text(approx_tokens: int, seed: int = 0) -> str:
    """A maintenance manual of about ``approx_tokens`` tokens, the same for the same inputs."""
    rng = random.Random(seed)
    lines = ["Maintenance manual of the pumping station."]
    for number in range(1, max(1, round(approx_tokens / TOKENS_PER_LINE)) + 1):
        lines.append(
            f"{number}. The {rng.choice(_PARTS)} of unit U-{rng.randint(100, 999)} runs at "
            f"{rng.randint(2, 900)} rpm and is inspected every {rng.randint(2, 12)} "
            f"{rng.choice(_PERIODS)}."
        )
    return "\n".join(lines)


def question(index: int) -> str:
    """Question ``index``: distinct for every index, so no two requests share a tail."""
    item = index % 50 + 1
    return f"Question {index}: which unit is item {item}, and how often is it inspected?"


def chat_body(doc_id: str, text: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": text}],
        "documents": [doc_id],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


# -- the server process --------------------------------------------------------------------
def engine_flags(config: EngineConfig) -> list[str]:
    """``ragserve serve`` flags reproducing ``config``: ``--field-name value`` per set field."""
    flags: list[str] = []
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        if item.name == "enable_prefix_caching":
            flags += [] if value else ["--no-prefix-caching"]
        elif value is not None:
            flags += [f"--{item.name.replace('_', '-')}", str(value)]
    return flags


def server_command(config: EngineConfig) -> list[str]:
    command = [sys.executable, "-m", "ragserve", "--log-level", "INFO", "serve"]
    return command + ["--host", HOST, "--port", "0", *engine_flags(config)]


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (graceful); SIGKILL if it is still there after ``timeout`` or on Ctrl-C."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
            finally:
                if self.process.poll() is None:
                    self.process.kill()
                    self.process.wait()
        return self.process.returncode


def start_server(command: list[str], log_path: Path, timeout: float) -> ServerProcess:
    """Start the server on port 0 and read the loopback port it logs; stopped on any failure.

    Raises CliError (with the end of its log) when it exits or does not start in time.
    """
    package_root = str(Path(__file__).resolve().parents[2])
    pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "TOKENIZERS_PARALLELISM": "false"}
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(process, "", log_path)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _SERVING.search(log_path.read_text(errors="replace"))
            if match:
                server.url = f"http://{HOST}:{match.group(1)}"
                return server
            if process.poll() is not None:
                raise CliError(
                    f"the server exited with {process.returncode}:\n{_log_tail(log_path)}"
                )
            time.sleep(0.2)
        raise CliError(f"the server did not start in {timeout:.0f} s:\n{_log_tail(log_path)}")
    except BaseException:
        server.stop()
        raise


def _log_tail(log_path: Path, chars: int = 3000) -> str:
    return log_path.read_text(errors="replace")[-chars:]


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit, so ``finally`` blocks (stopping the server) still run."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- HTTP ----------------------------------------------------------------------------------
@dataclass
class RequestResult:
    """One streamed chat. ``error`` is None for a complete stream with a usage chunk."""

    latency_s: float
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class LevelResult:
    concurrency: int
    wall_s: float
    results: list[RequestResult] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        done = [r for r in self.results if r.error is None]
        ttfts = [r.ttft_s for r in done if r.ttft_s is not None]
        prompt = sum(r.prompt_tokens for r in done)
        return {
            "concurrency": self.concurrency,
            "requests": len(self.results),
            "failures": len(self.results) - len(done),
            "wall_s": self.wall_s,
            "requests_per_s": len(done) / self.wall_s,
            "ttft_p50_s": percentile(ttfts, 0.50) if ttfts else None,
            "ttft_p99_s": percentile(ttfts, 0.99) if ttfts else None,
            "output_tokens_per_s": sum(r.completion_tokens for r in done) / self.wall_s,
            "cached_token_ratio": sum(r.cached_tokens for r in done) / prompt if prompt else None,
            "errors": sorted({r.error for r in self.results if r.error is not None})[:5],
        }


def percentile(values: list[float], fraction: float) -> float:
    """Linear interpolation between the closest ranks (``fraction`` in [0, 1])."""
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


async def wait_healthy(session: aiohttp.ClientSession, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with session.get(f"{url}/health") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health did not answer 200 within {timeout:.0f} s")
        await asyncio.sleep(0.2)


async def upload_document(
    session: aiohttp.ClientSession, url: str, text: str, timeout: float
) -> dict[str, Any]:
    """Upload and wait until the document leaves ``ingesting``; returns its final state."""
    async with session.post(f"{url}/v1/documents", json={"text": text}) as response:
        state: dict[str, Any] = await response.json()
        if response.status not in (200, 202):
            raise RuntimeError(f"document upload failed with {response.status}: {state}")
    deadline = time.monotonic() + timeout
    while state["status"] == "ingesting":
        if time.monotonic() > deadline:
            raise RuntimeError(f"document {state['id']} still ingesting after {timeout:.0f} s")
        await asyncio.sleep(0.1)
        async with session.get(f"{url}/v1/documents/{state['id']}") as response:
            state = await response.json()
    if state["status"] != "ready":
        raise RuntimeError(f"document {state['id']} is {state['status']}: {state.get('error')}")
    return state


async def stream_chat(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> RequestResult:
    """Send one streamed chat; never raises for a failed request (it is counted instead).

    TTFT is the time to the first chunk holding a choice: the server sends it once the
    first token is sampled (its text may still be held back by the detokenizer).
    """
    started = time.perf_counter()
    result = RequestResult(0.0)
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
            else:
                await _read_stream(response, result, started)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    result.latency_s = time.perf_counter() - started
    return result


async def _read_stream(
    response: aiohttp.ClientResponse, result: RequestResult, started: float
) -> None:
    done = False
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        if line == b"data: [DONE]":
            done = True
            break
        chunk = json.loads(line[len(b"data: ") :])
        if "error" in chunk:
            result.error = f"stream error: {chunk['error'].get('message', '')}"[:200]
            return
        if chunk.get("choices") and result.ttft_s is None:
            result.ttft_s = time.perf_counter() - started
        if chunk.get("usage"):
            usage = chunk["usage"]
            result.prompt_tokens = usage["prompt_tokens"]
            result.completion_tokens = usage["completion_tokens"]
            result.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
    if not done or not result.prompt_tokens:
        result.error = "the stream ended without [DONE] or without a usage chunk"


async def run_level(
    session: aiohttp.ClientSession, url: str, bodies: list[dict[str, Any]], concurrency: int
) -> LevelResult:
    """``concurrency`` closed-loop clients working through ``bodies`` once."""
    pending = iter(bodies)
    results: list[RequestResult] = []

    async def client() -> None:
        for body in pending:  # shared: each client takes the next body
            results.append(await stream_chat(session, url, body))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return LevelResult(concurrency, time.perf_counter() - started, results)


async def http_overhead(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], repeats: int
) -> tuple[list[float], dict[str, Any]]:
    """Round-trip seconds of ``repeats`` identical requests after one that caches the prompt."""
    timings: list[float] = []
    usage: dict[str, Any] = {}
    for attempt in range(repeats + 1):
        started = time.perf_counter()
        async with session.post(f"{url}/v1/chat/completions", json=body) as response:
            payload = await response.json()
            if response.status != 200:
                raise RuntimeError(f"overhead request failed with {response.status}: {payload}")
        if attempt:
            timings.append(time.perf_counter() - started)
        usage = payload["usage"]
    return timings, usage


@dataclass
class HttpRun:
    document: dict[str, Any]
    overhead_s: list[float]
    overhead_usage: dict[str, Any]
    levels: list[LevelResult]


async def measure_http(url: str, text: str, levels: list[int], args: argparse.Namespace) -> HttpRun:
    connector = aiohttp.TCPConnector(limit=max(levels))
    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await wait_healthy(session, url, args.server_timeout)
        started = time.perf_counter()
        document = await upload_document(session, url, text, args.request_timeout)
        document["ingest_s"] = time.perf_counter() - started
        doc_id = document["id"]
        overhead_body = chat_body(doc_id, OVERHEAD_QUESTION, 1, stream=False)
        timings, usage = await http_overhead(session, url, overhead_body, args.overhead_repeats)
        results = []
        for index, concurrency in enumerate(levels):
            first = index * args.requests_per_level
            bodies = [
                chat_body(doc_id, question(first + n), args.max_tokens, stream=True)
                for n in range(args.requests_per_level)
            ]
            results.append(await run_level(session, url, bodies, concurrency))
    return HttpRun(document, timings, usage, results)


# -- the offline engine --------------------------------------------------------------------
@dataclass
class OfflineRun:
    timings_s: list[float]
    prompt_tokens: int
    cached_tokens: int


def offline_overhead(config: EngineConfig, text: str, repeats: int) -> OfflineRun:
    """The overhead prompt's exact token ids through ``LLM.generate``: run once, then timed.

    As in the server, the engine is built on this thread and steps on a worker thread.
    NOTE: on the CPU, torch's intra-op threads behave differently on the thread that first
    ran a parallel op; on a busy two-core machine one 9-token step took 4.7 s there and
    0.15 s on a later thread (OpenMP spin-waiting), so the offline steps must run where the
    server's do for the ratio to measure HTTP and not the thread pool.
    """
    from ragserve import LLM, SamplingParams
    from ragserve.server.prompts import PromptBuilder

    llm = LLM.from_config(config)
    builder = PromptBuilder(llm.get_tokenizer())
    try:
        messages = [{"role": "user", "content": OVERHEAD_QUESTION}]
        ids = builder.chat_ids(messages, [builder.document_ids(text)])
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

        def timed() -> OfflineRun:
            llm.generate([ids], params, use_tqdm=False)
            timings: list[float] = []
            for _ in range(repeats):
                started = time.perf_counter()
                output = llm.generate([ids], params, use_tqdm=False)[0]
                timings.append(time.perf_counter() - started)
            return OfflineRun(timings, len(ids), output.num_cached_tokens)

        return on_worker_thread(timed)
    finally:
        builder.close()
        llm.close()


def on_worker_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a fresh daemon thread (so Ctrl-C is not held up by it); re-raises its error."""
    outcome: list[T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            outcome.append(fn())
        except BaseException as exc:  # handed to the caller
            failure.append(exc)

    thread = threading.Thread(target=target, name="ragserve-bench-offline", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]


# -- the whole run -------------------------------------------------------------------------
def run(args: argparse.Namespace, config: EngineConfig) -> int:
    """Run the benchmark; print the tables and write ``args.out``.

    Steps:

    1. Start ``ragserve serve`` in a subprocess on 127.0.0.1 (port 0, a free port) with this
       command's engine flags, wait for ``/health``, upload one deterministic long document and
       wait until it is ready (its blocks are pinned).
    2. Overhead: a non-streamed ``max_tokens=1`` chat on one cached prompt, median of
       ``--overhead-repeats`` round trips (after one untimed run that caches it).
    3. Load: for each ``--concurrency`` level, ``--requests-per-level`` streamed chats from that
       many concurrent clients, every one a distinct question on the document (so only the
       document is a shared prefix). Per level: requests/s, time to first token p50/p99,
       output tokens/s, cached-token ratio (``cached_tokens / prompt_tokens`` from the usage
       chunk) and failures.
    4. Stop the server, then time the same ``max_tokens=1`` prompt (the same token ids) on the
       offline engine in this process, and report HTTP median / offline median (target 1.2x).
       NOTE: the offline part runs only after the server has exited, so the two never compete
       for the cores or the accelerator.

    Traffic goes only to the loopback address the server is bound to. The server is always
    stopped (SIGTERM, SIGKILL if it lingers): on success, errors, Ctrl-C and SIGTERM.
    Exit code 1 when any request failed, else 0; the overhead target is reported, not enforced.
    """
    levels = validate(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.with_suffix(".server.log")
    text = document_text(args.doc_tokens)
    command = server_command(config)
    with sigterm_as_exit():
        server = start_server(command, log_path, args.server_timeout)
        try:
            served = asyncio.run(measure_http(server.url, text, levels, args))
        finally:
            server.stop()
        offline = offline_overhead(config, text, args.overhead_repeats)
    summaries = [level.summary() for level in served.levels]
    overhead = overhead_summary(served, offline)
    report(args, served.document, summaries, overhead)
    workload = {k: v for k, v in vars(args).items() if k != "func"}
    write_json(
        out,
        {
            "workload": workload,
            "server_command": command,
            "server_log": str(log_path),
            "document": served.document,
            "levels": summaries,
            "overhead": overhead,
        },
    )
    return 1 if any(s["failures"] for s in summaries) else 0


def overhead_summary(served: HttpRun, offline: OfflineRun) -> dict[str, Any]:
    http_s = statistics.median(served.overhead_s)
    offline_s = statistics.median(offline.timings_s)
    ratio = http_s / offline_s
    return {
        "http_median_s": http_s,
        "http_min_s": min(served.overhead_s),
        "offline_median_s": offline_s,
        "offline_min_s": min(offline.timings_s),
        "ratio": ratio,
        "target_ratio": OVERHEAD_TARGET,
        "within_target": ratio <= OVERHEAD_TARGET,
        "http_prompt_tokens": served.overhead_usage["prompt_tokens"],
        "http_cached_tokens": served.overhead_usage["prompt_tokens_details"]["cached_tokens"],
        "offline_prompt_tokens": offline.prompt_tokens,
        "offline_cached_tokens": offline.cached_tokens,
        "repeats": len(offline.timings_s),
    }


def report(
    args: argparse.Namespace,
    document: dict[str, Any],
    levels: list[dict[str, Any]],
    overhead: dict[str, Any],
) -> None:
    def ms(value: float | None) -> float | str:
        return "-" if value is None else value * 1000

    print_table(
        f"serve: document QA over HTTP, {document['tokens']}-token document "
        f"(ingested in {document['ingest_s']:.2f} s), {args.max_tokens} new tokens per answer",
        ["concurrency", "requests", "failures", "req/s", "TTFT p50 ms", "TTFT p99 ms",
         "out tok/s", "cached ratio"],
        [
            [s["concurrency"], s["requests"], s["failures"], s["requests_per_s"],
             ms(s["ttft_p50_s"]), ms(s["ttft_p99_s"]), s["output_tokens_per_s"],
             "-" if s["cached_token_ratio"] is None else s["cached_token_ratio"]]
            for s in levels
        ],
    )
    print_table(
        f"server overhead: max_tokens=1 on a cached {overhead['http_prompt_tokens']}-token "
        f"prompt, median of {overhead['repeats']}",
        ["path", "median ms", "min ms", "prompt tokens", "cached tokens"],
        [
            ["HTTP (non-streamed chat)", ms(overhead["http_median_s"]), ms(overhead["http_min_s"]),
             overhead["http_prompt_tokens"], overhead["http_cached_tokens"]],
            ["offline LLM.generate", ms(overhead["offline_median_s"]),
             ms(overhead["offline_min_s"]), overhead["offline_prompt_tokens"],
             overhead["offline_cached_tokens"]],
        ],
    )
    verdict = "within" if overhead["within_target"] else "OVER"
    print(f"\nHTTP / offline = {overhead['ratio']:.2f}x ({verdict} the {OVERHEAD_TARGET}x target)")
    if overhead["http_prompt_tokens"] != overhead["offline_prompt_tokens"]:
        print("warning: the HTTP and offline prompts differ in length (unequal work)")
    for s in levels:
        for error in s["errors"]:
            print(f"concurrency {s['concurrency']}: {error}")
