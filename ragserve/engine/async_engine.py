"""An asyncio front for the engine: one engine thread owns the step loop; callers stream.

Requests reach the engine thread through a thread-safe queue; each request's outputs
come back on its own asyncio queue. Cancelling the consumer (a client that went away)
aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ragserve.config import EngineConfig
from ragserve.document_reuse import DocumentReuse
from ragserve.engine.engine_info import EngineInfo, EngineSnapshot, KVModel
from ragserve.engine.llm_engine import LLMEngine
from ragserve.outputs import RequestOutput
from ragserve.sampling_params import SamplingParams
from ragserve.timeouts import within

logger = logging.getLogger(__name__)
T = TypeVar("T")

# NOTE: the engine thread runs calls between steps, so a call's timeout must exceed the
# longest step (a full prefill chunk on a slow device).
CALL_TIMEOUT_S = 30.0


class EngineRequestError(RuntimeError):
    """Why the engine stopped serving a request (other than rejecting its input)."""


class EngineDeadError(EngineRequestError):
    """The engine thread has stopped; no request can be served."""


class RequestAbortedError(EngineRequestError):
    """The request was aborted by ``AsyncEngine.abort`` while a consumer was reading it,
    or the engine gave up on it for want of KV room."""


class RequestFailedError(EngineRequestError):
    """This request alone failed inside the engine (sampling, detokenizing, ...); the
    requests it shared steps with went on unaffected."""


class EngineStepError(EngineRequestError):
    """A step failed in a way no single request explains (e.g. a kernel fault): every
    request in it was stopped; the engine goes on serving new ones."""


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None) -> None:
        # NOTE: the engine thread prepares itself (per-thread GPU state) before its first step.
        self.engine = (
            engine
            if engine is not None
            else LLMEngine(config or EngineConfig(), prepare_this_thread=False)
        )
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._sinks: dict[str, _Sink] = {}
        self._ids = itertools.count()
        self._stopping = threading.Event()
        # When the engine thread last finished a loop turn: a stalled step shows as an old
        # value while requests wait (see ``stalled_for``).
        self._last_turn = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="ragserve-engine", daemon=True)
        self._thread.start()

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def num_active_requests(self) -> int:
        return len(self._sinks)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    def stalled_for(self) -> float:
        """Seconds the engine thread has been inside one turn while requests wait; 0 when idle."""
        if not self._sinks:
            return 0.0
        return max(0.0, time.monotonic() - self._last_turn)

    # -- calls from the event loop ----------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        namespace: str = "",
        queued: Callable[[], None] | None = None,
        reuse: DocumentReuse | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs; the last one has ``finished=True``.

        ``queued`` is called once the request is in the engine's command queue (on the
        first iteration): later calls (a purge) run after its admission.
        Raises ValueError (before any output) when the engine rejects the request.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        request_id = request_id or f"req-{next(self._ids)}"
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        if request_id in self._sinks:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._sinks[request_id] = sink

        def add() -> None:
            try:
                if reuse is None:
                    self.engine.add_request(request_id, prompt, params, namespace=namespace)
                else:
                    self.engine.add_request(
                        request_id,
                        prompt,
                        params,
                        namespace=namespace,
                        documents=reuse.documents,
                        kv_reuse=reuse.kv_reuse,
                        recompute_ratio=reuse.recompute_ratio,
                    )
            except Exception as exc:
                self._sinks.pop(request_id, None)
                if not isinstance(exc, ValueError):  # a fault, not a rejection of the input
                    logger.exception("adding request %s failed", request_id)
                    self.engine.abort_request(request_id)
                    exc = RequestFailedError(
                        f"the request could not be added: {type(exc).__name__}: {exc}"
                    )
                sink.put(exc)

        self._commands.put(add)
        if queued is not None:
            queued()
        finished = False
        try:
            while True:
                item = await sink.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed on the engine thread.

        A consumer still reading the request gets ``RequestAbortedError``.
        """
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink.put(RequestAbortedError(f"request {request_id} was aborted"))

        def abort() -> None:
            self.engine.abort_request(request_id)

        self._commands.put(abort)

    async def call(self, fn: Callable[[LLMEngine], T], timeout: float | None = None) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result.

        Raises EngineDeadError when the engine is not running, or has not answered within
        ``timeout`` seconds (None: no limit).
        """
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except BaseException as exc:  # handed to the caller
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._commands.put(run)
        try:
            return await within(future, timeout)
        except asyncio.TimeoutError:  # NOTE: not the builtin on Python 3.10
            raise EngineDeadError(f"the engine did not answer within {timeout:.0f} s") from None

    async def flush_shared_tiers(self, timeout: float) -> bool:
        """Wait, off the engine thread, until the shared KV tiers have sent the blocks queued
        so far (other replicas read them there); False if that took over ``timeout`` s."""
        tiers = self.engine.tiers
        if tiers is None:
            return True
        # NOTE: the thread keeps the time limit itself, so it never outlives the wait.
        return await asyncio.to_thread(tiers.flush_shared, timeout)

    async def snapshot(self, timeout: float | None = CALL_TIMEOUT_S) -> EngineSnapshot:
        """``LLMEngine.snapshot`` read on the engine thread; EngineDeadError as for ``call``."""
        return await self.call(LLMEngine.snapshot, timeout)

    async def pin_prefix(
        self,
        pin_id: str,
        token_ids: list[int],
        namespace: str = "",
        namespace_share: float = 1.0,
        timeout: float | None = CALL_TIMEOUT_S,
    ) -> int:
        """``LLMEngine.pin_prefix`` on the engine thread; EngineDeadError as for ``call``."""
        return await self.call(
            lambda engine: engine.pin_prefix(pin_id, token_ids, namespace, namespace_share), timeout
        )

    async def unpin_prefix(self, pin_id: str, timeout: float | None = CALL_TIMEOUT_S) -> bool:
        """``LLMEngine.unpin_prefix`` on the engine thread; EngineDeadError as for ``call``.

        Calls run in order, so this also undoes a pin queued before it.
        """
        return await self.call(lambda engine: engine.unpin_prefix(pin_id), timeout)

    async def purge_prefix(
        self,
        token_ids: list[int],
        namespace: str = "",
        keep: list[list[int]] | None = None,
        timeout: float | None = CALL_TIMEOUT_S,
        model: KVModel | None = None,
    ) -> dict[str, int]:
        """``LLMEngine.purge_prefix`` on the engine thread; EngineDeadError as for ``call``."""
        return await self.call(
            lambda engine: engine.purge_prefix(token_ids, namespace, keep, model), timeout
        )

    async def purge_prefixes(
        self,
        sequences: list[list[int]],
        namespace: str = "",
        keep: list[list[int]] | None = None,
        timeout: float | None = CALL_TIMEOUT_S,
        model: KVModel | None = None,
    ) -> dict[str, int]:
        """``LLMEngine.purge_prefixes`` on the engine thread; EngineDeadError as for ``call``."""
        return await self.call(
            lambda engine: engine.purge_prefixes(sequences, namespace, keep, model), timeout
        )

    async def locate_prefix(
        self, token_ids: list[int], namespace: str = "", timeout: float | None = CALL_TIMEOUT_S
    ) -> dict[str, int]:
        """``LLMEngine.locate_prefix`` on the engine thread; EngineDeadError as for ``call``."""
        return await self.call(lambda engine: engine.locate_prefix(token_ids, namespace), timeout)

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread, abort unfinished requests, flush the disk tier."""
        self._stopping.set()
        self._commands.put(lambda: None)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout)
        if not self._thread.is_alive():
            self.engine.shutdown()

    # -- the engine thread -----------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        try:
            engine.prepare_thread()
        except Exception:  # NOTE: only start-up work is lost; plans then build on first use
            logger.exception("preparing the engine thread failed")
        while not self._stopping.is_set():
            self._last_turn = time.monotonic()
            idle = not engine.has_unfinished_requests()
            try:
                command = self._commands.get(timeout=0.5) if idle else self._commands.get_nowait()
            except queue.Empty:
                command = None
            while command is not None:
                _run_guarded(command, "an engine command")
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if not engine.has_unfinished_requests() or self._stopping.is_set():
                _run_guarded(engine.background_work, "background work")
                continue
            try:
                outputs = engine.step()
            except Exception as exc:
                logger.exception("engine step failed; aborting its requests")
                self._fail_all(
                    EngineStepError(
                        "the engine step failed and stopped every request in it "
                        f"({type(exc).__name__}: {exc}); new requests are served"
                    )
                )
                _run_guarded(engine.abort_internal_requests, "aborting internal requests")
                continue
            self._dispatch(outputs)
        self._fail_all(EngineDeadError("the engine shut down"))
        self._run_pending_commands()

    def _run_pending_commands(self) -> None:
        """Answer calls queued while the loop was stopping, so no awaiting caller hangs."""
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                return

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            # A finished request leaves the sinks before its caller can see its last output.
            if output.finished:
                sink = self._sinks.pop(output.request_id, None)
            else:
                sink = self._sinks.get(output.request_id)
            if sink is not None:
                sink.put(_as_error(output) if output.error else output)

    def _fail_all(self, exc: BaseException) -> None:
        """Fail every request with a sink. NOTE: sinks are popped one by one, never cleared
        at once: a request registered by the event loop meanwhile keeps its sink and runs."""
        for request_id in list(self._sinks):
            sink = self._sinks.pop(request_id, None)
            if sink is None:
                continue
            try:
                self.engine.abort_request(request_id)
            except Exception:  # NOTE: the others must still be failed and freed
                logger.exception("aborting request %s failed", request_id)
            sink.put(exc)


def _as_error(output: RequestOutput) -> BaseException:
    if output.error_code == "request_failed":
        return RequestFailedError(f"this request failed: {output.error}")
    return RequestAbortedError(output.error)


def _run_guarded(fn: Callable[[], None], what: str) -> None:
    """Run ``fn`` on the engine thread; an exception is logged, never kills the thread.

    NOTE: commands report their own errors to their callers (``call``, ``generate``);
    what reaches here is a bug, and the loop must go on serving the others.
    """
    try:
        fn()
    except Exception:
        logger.exception("%s failed", what)


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
