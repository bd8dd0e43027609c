"""The engine: requests in, one schedule → run → postprocess step at a time, outputs out."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kernels.registry import get_backend
from kvstore.block_pool import BlockPool
from kvstore.device_cache import KVCacheSpec
from kvstore.hashing import hash_full_blocks, make_salt
from kvstore.kv_cache_manager import KVAllocation, KVCacheManager
from kvstore.record_cipher import RecordCipher
from kvstore.tier import TierMetrics
from kvstore.tier_stack import TierStack, TierTraffic
from ragserve.config import EngineConfig
from ragserve.engine.detokenizer import IncrementalDetokenizer
from ragserve.engine.engine_info import EngineInfo, EngineSnapshot, KVBlockUsage
from ragserve.engine.model_runner import ModelRunner
from ragserve.engine.sampler import (
    DeviceSamples,
    SampleRequest,
    read_samples,
    sample_on_device,
    to_device_async,
)
from ragserve.engine.scheduler import Scheduler
from ragserve.engine.sequence import Sequence
from ragserve.models.loader import LoadedModel, load_model_from_config
from ragserve.outputs import CompletionOutput, RequestOutput
from ragserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Pinned documents may hold at most this share of the device KV blocks.
MAX_PINNED_FRACTION = 0.5
FAIL_SAMPLING_ENV = "RAGSERVE_TEST_FAIL_SAMPLING_MARKER"


class InjectedFault(RuntimeError):
    """Raised by the test-only sampling fault hook (``FAIL_SAMPLING_ENV``)."""


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens_computed: int = 0  # prompt tokens run through the model (cache misses)
    generated_tokens: int = 0
    num_finished: int = 0
    kv_tokens_stored: int = 0  # summed over steps: tokens held by scheduled sequences
    kv_slots_allocated: int = 0  # summed over steps: slots of the blocks holding them
    steps_ahead: int = 0  # steps launched before the previous step's tokens were read

    @property
    def kv_utilisation(self) -> float:
        """Time-averaged share of allocated KV slots that hold a token."""
        return self.kv_tokens_stored / self.kv_slots_allocated if self.kv_slots_allocated else 0.0


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float
    first_token_time: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


@dataclass
class _LaunchedStep:
    """A step queued on the device whose sampled tokens the host has not read yet.

    ``seqs`` are the sequences that sample a token, in row order; ``rows[i]`` is the row
    of ``seqs[i]`` in ``samples`` (None: row ``i``).
    """

    seqs: list[Sequence]
    samples: DeviceSamples | None
    rows: list[int] | None = None

    def row(self, index: int) -> int:
        return index if self.rows is None else self.rows[index]


class _Pin(NamedTuple):
    """A pinned prefix and the namespace whose share of the pin budget it counts against."""

    namespace: str
    alloc: KVAllocation


class _TierReading(NamedTuple):
    """What the face reports of the tiers below the device (all copies)."""

    metrics: dict[str, TierMetrics]
    traffic: TierTraffic | None
    disk_dir: Path | None


class LLMEngine:
    def __init__(self, config: EngineConfig, *, prepare_this_thread: bool = True) -> None:
        """``prepare_this_thread=False`` leaves ``prepare_thread`` to the thread that will
        step the engine (``AsyncEngine`` does that)."""
        self.config = config
        self.prepared_threads: set[int] = set()
        started = time.perf_counter()
        self.loaded: LoadedModel = load_model_from_config(config)
        self.device = self.loaded.device
        self.dtype = self.loaded.dtype
        self.tokenizer: Any = self.loaded.tokenizer
        self.model_name = self.loaded.name
        self.max_model_len = self.loaded.max_model_len
        self.eos_token_ids = list(self.loaded.eos_token_ids)

        shape = self.loaded.model.shape
        self.kv_spec = KVCacheSpec(
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            block_size=config.block_size,
            dtype=self.dtype,
        )
        num_blocks = self.kv_spec.num_blocks_for(self._kv_budget_bytes())
        if num_blocks < 1:
            raise ValueError(
                f"the KV budget holds no block of {self.kv_spec.bytes_per_block} bytes; "
                "raise kv_cache_gib"
            )
        self.kv_cache = self.kv_spec.allocate(num_blocks, self.device)
        self.block_pool = BlockPool(num_blocks)
        self.tiers = self._open_tiers()
        self.kv_manager = KVCacheManager(
            self.block_pool,
            config.block_size,
            config.enable_prefix_caching,
            tiers=self.tiers,
            max_load_bytes_per_step=int(config.kv_load_gib_per_step * 2**30),
        )
        self.scheduler = Scheduler(
            self.kv_manager, config.max_num_batched_tokens, config.max_num_seqs
        )
        backend = get_backend(config.attention_backend, self.device)
        self.runner = ModelRunner(
            self.loaded.model, self.kv_cache, backend, config.block_size, self.device
        )
        if self.device.type == "cuda":
            self.runner.warm_up(config.max_num_batched_tokens, self.max_model_len, num_blocks)
        if self.device.type == "cuda" and backend.supports_cuda_graphs and not config.enforce_eager:
            self.runner.capture_decode_graphs(config.max_num_seqs, self.max_model_len)
        if prepare_this_thread:
            self.prepare_thread()
        self.stats = EngineStats()
        self._requests: dict[str, _Request] = {}
        self._salts: dict[str, bytes] = {}
        self._pins: dict[str, _Pin] = {}
        self._next_seq_id = 0
        async_scheduling = config.async_scheduling
        self.async_scheduling = (
            self.device.type == "cuda" if async_scheduling is None else async_scheduling
        )
        self._lookahead: _LaunchedStep | None = None
        # Outputs of requests failed alone during a step, returned with that step's outputs.
        self._failed: list[RequestOutput] = []
        # Test-only: requests whose id contains this marker fail while sampling (set from
        # RAGSERVE_TEST_FAIL_SAMPLING_MARKER), to exercise the isolation of request faults.
        self.fail_sampling_marker: str | None = os.environ.get(FAIL_SAMPLING_ENV) or None
        self.info = self._make_info(backend.name)
        logger.info(
            "engine ready in %.1fs: %s on %s (%s), %d KV blocks of %d tokens (%.2f GiB), "
            "attention %s, decode %s",
            time.perf_counter() - started,
            self.model_name,
            self.device,
            str(self.dtype).removeprefix("torch."),
            num_blocks,
            config.block_size,
            num_blocks * self.kv_spec.bytes_per_block / 2**30,
            backend.name,
            "eager" if self.runner.decode_graphs is None else "in CUDA graphs",
        )

    def _open_tiers(self) -> TierStack | None:
        config = self.config
        disk_gib = config.disk_tier_gib
        if not config.enable_prefix_caching or (config.kv_cpu_gib <= 0 and disk_gib <= 0):
            return None
        if config.kv_disk_gib is None and disk_gib > 0:
            logger.info(
                "disk KV tier on in %s with the default budget of %g GiB (--kv-disk-gib sets it)",
                config.kv_disk_dir or "the default folder", disk_gib,
            )  # fmt: skip
        cipher = None
        if config.kv_encryption_key_file:
            try:
                cipher = RecordCipher.from_file(config.kv_encryption_key_file)
            except (OSError, ValueError) as exc:
                raise ValueError(f"the KV encryption key cannot be used: {exc}") from exc
        try:
            return TierStack.from_budgets(
                self.kv_cache,
                self.block_pool,
                cpu_gib=config.kv_cpu_gib,
                disk_gib=disk_gib,
                disk_dir=config.kv_disk_dir,
                cipher=cipher,
            )
        except OSError as exc:
            raise ValueError(f"the KV disk directory cannot be used: {exc}") from exc

    def background_work(self) -> None:
        """Cheap upkeep run before each step and while idle: queue pending disk writes."""
        if self.tiers is not None:
            self.tiers.drain_backlog()

    def shutdown(self) -> None:
        """Abort what is running, then flush queued disk-tier writes and close the tiers."""
        for request_id in list(self._requests):
            self.abort_request(request_id)
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None

    def _kv_budget_bytes(self) -> float:
        if self.config.kv_cache_gib is not None:
            return self.config.kv_cache_gib * 2**30
        if self.device.type == "cuda":
            # NOTE: an engine dropped without close() may still hold memory until the
            # collector runs; count only what is really in use.
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave room for activations of the largest step and the allocator's slack.
            reserve = 2**30 + self.config.max_num_batched_tokens * 64 * 1024
            return max(0.0, free - (1 - self.config.gpu_memory_utilization) * total - reserve)
        # On the CPU: enough for every sequence at full length, at most 4 GiB.
        wanted = self.config.max_num_seqs * self.max_model_len * self.kv_spec.bytes_per_token
        return float(min(wanted, 4 * 2**30))

    def prepare_thread(self) -> None:
        """Build what the calling thread keeps for itself, before it steps the engine.

        PyTorch caches cuDNN's attention plans per thread, so they are built (by the
        backend's ``warm_up``) in the thread that will run the steps; once per thread.
        """
        thread = threading.get_ident()
        if thread in self.prepared_threads:
            return
        self.prepared_threads.add(thread)
        started = time.perf_counter()
        capacity = self.block_pool.num_blocks * self.config.block_size
        self.runner.prepare_attention(
            self.config.max_num_batched_tokens, min(self.max_model_len, capacity)
        )
        if self.device.type == "cuda":
            logger.info("attention plans built in %.1fs", time.perf_counter() - started)

    @property
    def num_kv_blocks(self) -> int:
        return self.block_pool.num_blocks

    # -- the read-only face ------------------------------------------------------------------
    def _make_info(self, attention_backend: str) -> EngineInfo:
        config = self.config
        tiers = self._read_tiers()
        cpu, disk = tiers.metrics.get("cpu"), tiers.metrics.get("disk")
        return EngineInfo(
            model_name=self.model_name,
            model_fingerprint=self.loaded.fingerprint,
            device=self.device,
            dtype=self.dtype,
            model_shape=self.loaded.model.shape,
            weight_bytes=sum(p.numel() * p.element_size() for p in self.loaded.model.parameters()),
            eos_token_ids=tuple(self.eos_token_ids),
            max_model_len=self.max_model_len,
            block_size=config.block_size,
            num_kv_blocks=self.num_kv_blocks,
            kv_bytes_per_block=self.kv_spec.bytes_per_block,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
            attention_backend=attention_backend,
            cpu_tier_bytes=cpu.capacity_bytes if cpu is not None else None,
            disk_tier_dir=tiers.disk_dir,
            disk_tier_key_file=config.kv_encryption_key_file if tiers.disk_dir else None,
            disk_tier_bytes=disk.capacity_bytes if disk is not None else None,
        )

    def snapshot(self) -> EngineSnapshot:
        """The engine's counters, copied; call it on the thread that steps the engine."""
        counters = self.kv_manager.counters
        tiers = self._read_tiers()
        return EngineSnapshot(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            requests_in_flight=self.num_requests,
            kv_blocks=KVBlockUsage(**self.kv_usage()),
            queried_tokens=counters.queried_tokens,
            hit_tokens=counters.hit_tokens,
            prompt_tokens_computed=self.stats.prompt_tokens_computed,
            generated_tokens=self.stats.generated_tokens,
            steps=self.stats.steps,
            steps_ahead=self.stats.steps_ahead,
            preemptions=self.scheduler.num_preemptions,
            kv_utilisation=self.stats.kv_utilisation,
            tier_metrics=tiers.metrics,
            tier_traffic=tiers.traffic,
        )

    def _read_tiers(self) -> _TierReading:
        """The one place the face reads the tier stack."""
        if self.tiers is None:
            return _TierReading({}, None, None)
        disk_dir = next((Path(t.location) for t in self.tiers.describe() if t.location), None)
        return _TierReading(self.tiers.metrics(), dataclasses.replace(self.tiers.traffic), disk_dir)

    # -- requests ----------------------------------------------------------------------------
    def salt_for(self, namespace: str) -> bytes:
        salt = self._salts.get(namespace)
        if salt is None:
            kv_dtype = str(self.dtype).removeprefix("torch.")
            salt = make_salt(self.loaded.fingerprint, self.config.block_size, kv_dtype, namespace)
            self._salts[namespace] = salt
        return salt

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token id lists")
            return prompt, list(self.tokenizer.encode(prompt))
        return None, [int(t) for t in prompt]

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        namespace: str = "",
        persist: bool = False,
    ) -> None:
        """Validate and queue one request; raises ValueError with the numbers when it cannot run.

        ``persist`` writes the request's computed blocks through to the disk tier at once.
        """
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        self._validate(token_ids, params)
        now = time.monotonic()
        seqs = []
        for index in range(params.n):
            generator = None
            if not params.greedy:
                seed = params.seed + index if params.seed is not None else self._fresh_seed()
                generator = torch.Generator(device=self.device).manual_seed(seed)
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(
                    self.tokenizer, token_ids, params.stop_strings, params.skip_special_tokens
                )
            seq = Sequence(
                seq_id=self._next_seq_id,
                request_id=request_id,
                index=index,
                token_ids=list(token_ids),
                num_prompt_tokens=len(token_ids),
                params=params,
                kv=KVAllocation(salt=self.salt_for(namespace), persist=persist),
                detokenizer=detok,
                generator=generator,
                tenant=namespace,
                arrival_time=now,
            )
            self._next_seq_id += 1
            self.kv_manager.update_hashes(seq.kv, seq.token_ids)
            seqs.append(seq)
        self._requests[request_id] = _Request(request_id, text, token_ids, params, seqs, now)
        for seq in seqs:
            self.scheduler.add(seq)

    def _fresh_seed(self) -> int:
        return (self.config.seed * 1_000_003 + self._next_seq_id) & 0x7FFF_FFFF_FFFF_FFFF

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: it needs at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is "
                f"{self.max_model_len} (which must leave room for at least one new token)"
            )
        vocab = self.loaded.model.shape.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none")
        if params.top_k > vocab:
            raise ValueError(
                f"top_k must be -1 or at most the vocabulary size {vocab}, got {params.top_k}"
            )
        bad_stops = [t for t in params.stop_token_ids or () if t >= vocab]
        if bad_stops:
            raise ValueError(
                f"stop_token_ids {bad_stops[:5]} are outside the vocabulary [0, {vocab})"
            )
        total = len(token_ids) + self._max_new_tokens(len(token_ids), params)
        needed = self.kv_manager.blocks_needed(total)
        if needed > self.num_kv_blocks:
            raise ValueError(
                f"the request needs {needed} KV blocks ({total} tokens) but the cache holds "
                f"{self.num_kv_blocks} blocks of {self.config.block_size} tokens; "
                "lower max_tokens or raise kv_cache_gib"
            )

    def _max_new_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        room = self.max_model_len - num_prompt_tokens
        return room if params.max_tokens is None else min(room, params.max_tokens)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks. False if it is unknown or already done."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def reset_prefix_cache(self) -> int:
        return self.kv_manager.reset_prefix_cache()

    def pin_prefix(
        self, pin_id: str, token_ids: list[int], namespace: str = "", namespace_share: float = 1.0
    ) -> int:
        """Hold references on the cached full blocks of ``token_ids`` so they are never evicted.

        Returns how many leading tokens are pinned (the cached full blocks found now): 0
        when pinning them would take all pins past ``MAX_PINNED_FRACTION`` of the KV blocks
        (the pin budget), or the pins of ``namespace`` past ``namespace_share`` of that budget.
        """
        if not 0.0 <= namespace_share <= 1.0:
            raise ValueError(f"namespace_share must be in [0, 1], got {namespace_share}")
        self.unpin_prefix(pin_id)
        alloc = KVAllocation(salt=self.salt_for(namespace))
        self.kv_manager.update_hashes(alloc, token_ids)
        self.kv_manager.begin_step()  # between steps: a step's worth of tier loads
        pinned = self.kv_manager.match_prefix(alloc, token_ids, 0, leave_one=False)
        blocks = set(alloc.block_table)
        limit = int(self.block_pool.num_blocks * MAX_PINNED_FRACTION)
        own_limit = int(limit * namespace_share)
        held = {block for pin in self._pins.values() for block in pin.alloc.block_table}
        own = {
            b
            for pin in self._pins.values()
            if pin.namespace == namespace
            for b in pin.alloc.block_table
        }
        if len(held | blocks) > limit or len(own | blocks) > own_limit:
            # NOTE: pins may never starve requests (or one tenant's pins another's) of
            # blocks; the document stays cached (and on disk with a disk tier), just evictable.
            self.kv_manager.free(alloc)
            logger.warning(
                "not pinning %s: pins would hold more than %d of %d KV blocks, or this "
                "namespace's more than %d",
                pin_id,
                limit,
                self.block_pool.num_blocks,
                own_limit,
            )
            return 0
        self._pins[pin_id] = _Pin(namespace, alloc)
        if self.tiers is not None:  # pinned documents persist, whoever computed their blocks
            for block in alloc.block_table:
                identity = self.block_pool.identities[block]
                if identity is not None and not self.tiers.contains(identity):
                    self.tiers.persist(block, identity)
        return pinned

    def unpin_prefix(self, pin_id: str) -> bool:
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            return False
        self.kv_manager.free(pin.alloc)
        return True

    def purge_prefix(
        self, token_ids: list[int], namespace: str = "", keep: list[list[int]] | None = None
    ) -> dict[str, int]:
        """Remove the cached full blocks of ``token_ids`` for good: from the prefix cache
        (without demoting them) and every tier, with every block that follows them in a
        chain; blocks that a sequence of ``keep`` (same namespace) also has stay.

        Returns blocks removed: ``device`` (prefix-cache entries) and one count per tier.
        Unpin first: a pinned block stays with its pin, only unindexed."""
        salt = self.salt_for(namespace)
        size = self.config.block_size
        owned = hash_full_blocks(salt, token_ids, size)
        kept = {h for other in keep or () for h in hash_full_blocks(salt, other, size)}
        counts = self.kv_manager.purge(salt, owned, kept)
        return {"device": counts.device, **counts.tiers}

    def locate_prefix(self, token_ids: list[int], namespace: str = "") -> dict[str, int]:
        """Full blocks of ``token_ids`` held now: ``device`` and one count per tier."""
        salt = self.salt_for(namespace)
        hashes = hash_full_blocks(salt, token_ids, self.config.block_size)
        return self.kv_manager.locate(salt, hashes)

    def kv_usage(self) -> dict[str, int]:
        """Device blocks: total, in use by requests, pinned, cached (indexed), free."""
        pool = self.block_pool
        pinned = len({b for pin in self._pins.values() for b in pin.alloc.block_table})
        return {
            "total": pool.num_blocks,
            "used": pool.num_used - pinned,
            "pinned": pinned,
            "cached": pool.num_cached,
            "free": pool.num_free,
        }

    # -- the step --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one batch; return the outputs of every request that advanced.

        With asynchronous scheduling a steady decode batch runs one step ahead: the next
        step is launched (fed the sampled ids on the device) before this step's tokens are
        read, so the host's bookkeeping overlaps the device's work. The step ahead is
        taken as the next step if its sequences are still running; rows of sequences that
        stopped meanwhile are dropped (their extra KV slot lies past their last token).
        """
        self.background_work()
        launched = self._take_lookahead() or self._launch_scheduled()
        if launched is None:
            head = self.scheduler.waiting.peek()
            if head is not None and not self.scheduler.running:
                return [*self._take_failed(), self._reject_unschedulable(head)]
            return self._take_failed()
        if self._may_look_ahead(launched):
            self._lookahead = self._launch_lookahead(launched)
        outputs = self._finish(launched)
        return [*self._take_failed(), *outputs]

    def _take_failed(self) -> list[RequestOutput]:
        failed, self._failed = self._failed, []
        return failed

    def _fail_request(self, request_id: str, message: str) -> None:
        """Fail one request alone (a fault of its own); the rest of the step goes on.

        Its output, with ``error`` set, is returned by the current step.
        """
        request = self._requests.get(request_id)
        if request is None:
            return
        logger.warning("request %s failed alone: %s", request_id, message)
        output = self._safe_output(request)
        output.finished = True
        output.error = message
        output.error_code = "request_failed"
        self.abort_request(request_id)
        self._failed.append(output)

    def _safe_output(self, request: _Request) -> RequestOutput:
        """The request's output, or a bare one when building it is what failed."""
        try:
            return self._make_output(request)
        except Exception:
            return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, [])

    def _launch_scheduled(self) -> _LaunchedStep | None:
        batch = self.scheduler.schedule()
        if not batch:
            return None
        logits = self.runner.execute(batch.seqs, batch.num_new_tokens)
        self.stats.steps += 1
        self._track_kv_utilisation(batch.seqs, batch.num_new_tokens)
        sampling = [
            seq
            for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True)
            if self._advance(seq, num_new)
        ]
        return self._sample(logits, sampling)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], ahead: int = 0) -> _LaunchedStep:
        """Draw a token for each row of ``logits`` (row ``i`` is ``seqs[i]``).

        A draw that raises is retried row by row to find the requests at fault; they fail
        alone, and the others draw exactly what they would have drawn without them (each
        row is sampled on its own, and generator states are restored for the retry).
        """
        if not seqs:
            return _LaunchedStep([], None)
        requests = [self._sample_request(seq, ahead) for seq in seqs]
        states = [r.generator.get_state() if r.generator is not None else None for r in requests]
        try:
            return _LaunchedStep(seqs, self._draw(logits, requests))
        except Exception:
            logger.warning("sampling a batch of %d rows failed; retrying row by row", len(seqs))
        failed: set[str] = set()
        for row, request in enumerate(requests):
            _restore(requests, states)
            try:
                self._draw(logits[row : row + 1], [request])
            except Exception as exc:
                failed.add(seqs[row].request_id)
                self._fail_request(
                    seqs[row].request_id, f"sampling failed: {type(exc).__name__}: {exc}"
                )
        _restore(requests, states)
        keep = [row for row, seq in enumerate(seqs) if seq.request_id not in failed]
        if not keep:
            return _LaunchedStep([], None)
        rows = to_device_async(keep, torch.int64, logits.device)
        kept = [requests[row] for row in keep]
        return _LaunchedStep([seqs[row] for row in keep], self._draw(logits[rows], kept))

    def _draw(self, logits: torch.Tensor, requests: list[SampleRequest]) -> DeviceSamples:
        if self.fail_sampling_marker is not None:
            for request in requests:
                if self.fail_sampling_marker in request.request_id:
                    raise InjectedFault(f"injected sampling fault for {request.request_id}")
        return sample_on_device(logits, requests)

    def _take_lookahead(self) -> _LaunchedStep | None:
        """The step launched ahead, as this step, without the sequences that stopped since."""
        ahead, self._lookahead = self._lookahead, None
        if ahead is None:
            return None
        keep = [index for index, seq in enumerate(ahead.seqs) if not seq.is_finished]
        if not keep:
            return None
        seqs = [ahead.seqs[index] for index in keep]
        self.stats.steps += 1
        self.stats.steps_ahead += 1
        self._track_kv_utilisation(seqs, [1] * len(seqs))
        for seq in seqs:
            sampled = self._advance(seq, 1)
            assert sampled, "a step ahead computes each sequence's last known token"
        if len(keep) == len(ahead.seqs):
            return ahead
        return _LaunchedStep(seqs, ahead.samples, [ahead.row(index) for index in keep])

    def _may_look_ahead(self, launched: _LaunchedStep) -> bool:
        """Steady decoding: every running sequence samples now and nobody waits to join."""
        return (
            self.async_scheduling
            and launched.samples is not None
            and not self.scheduler.waiting
            and len(launched.seqs) == len(self.scheduler.running)
            and all(seq.params.logprobs is None for seq in launched.seqs)
        )

    def _launch_lookahead(self, launched: _LaunchedStep) -> _LaunchedStep | None:
        """Queue the next decode step of ``launched``'s sequences, fed its ids on the device."""
        assert launched.samples is not None
        indices = [
            index
            for index, seq in enumerate(launched.seqs)
            # NOTE: after this step's token a sequence may still stop (EOS, stop strings),
            # but one whose length limit it reaches now stops for sure.
            if seq.num_output_tokens + 1 < self._max_new_tokens(seq.num_prompt_tokens, seq.params)
        ]
        seqs = [launched.seqs[index] for index in indices]
        for seq in seqs:
            if not self.kv_manager.allocate(seq.kv, seq.num_computed_tokens + 1):
                return None  # the normal step frees room (by preemption) if it must
        if not seqs:
            return None
        rows = [launched.row(index) for index in indices]
        token_ids = launched.samples.token_ids
        if rows != list(range(len(token_ids))):
            token_ids = token_ids[to_device_async(rows, torch.int64, token_ids.device)]
        logits = self.runner.execute(seqs, [1] * len(seqs), next_token_ids=token_ids)
        ahead = self._sample(logits, seqs, ahead=1)
        return ahead if ahead.samples is not None else None

    def _finish(self, launched: _LaunchedStep) -> list[RequestOutput]:
        """Read the step's tokens (the host sync) and advance its sequences and requests."""
        results = read_samples(launched.samples) if launched.samples is not None else []
        now = time.monotonic()
        touched: dict[str, _Request] = {}
        for index, seq in enumerate(launched.seqs):
            request = self._requests.get(seq.request_id)
            if request is None or seq.is_finished:
                continue  # failed alone earlier in this step
            touched[seq.request_id] = request
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = max(0, seq.num_prompt_tokens - seq.prompt_tokens_computed)
                self.kv_manager.record_admission(seq.num_prompt_tokens, seq.num_cached_tokens)
            if request.first_token_time is None:
                request.first_token_time = now
            result = results[launched.row(index)]
            if result.error is not None:
                self._fail_request(seq.request_id, f"reading logprobs failed: {result.error}")
                continue
            try:
                self._append_token(seq, result.token_id, result.logprob, result.top_logprobs)
            except Exception as exc:
                self._fail_request(
                    seq.request_id, f"detokenizing failed: {type(exc).__name__}: {exc}"
                )
                continue
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
        outputs = []
        for request in touched.values():
            if request.request_id not in self._requests:
                continue
            try:
                output = self._make_output(request)
            except Exception as exc:
                self._fail_request(
                    request.request_id, f"building the output failed: {type(exc).__name__}: {exc}"
                )
                continue
            outputs.append(output)
            if request.finished:
                del self._requests[request.request_id]
                self.stats.num_finished += 1
        return outputs

    def _reject_unschedulable(self, seq: Sequence) -> RequestOutput:
        """Nothing runs and the head of the queue still cannot get its blocks: fail it alone.

        Validation guarantees a request fits an empty cache, so this happens only while
        pinned documents hold the room it needs.
        """
        request = self._requests[seq.request_id]
        usage = self.kv_usage()
        output = self._make_output(request)
        output.finished = True
        output.error = (
            f"no room in the KV cache: pinned documents hold {usage['pinned']} of "
            f"{usage['total']} blocks; delete documents or raise kv_cache_gib"
        )
        self.abort_request(seq.request_id)
        return output

    def _advance(self, seq: Sequence, num_new: int) -> bool:
        """Record ``num_new`` computed tokens; True if the sequence's next token is sampled now."""
        start = seq.num_computed_tokens
        seq.num_computed_tokens += num_new
        prompt_tokens = max(0, min(seq.num_computed_tokens, seq.num_prompt_tokens) - start)
        self.stats.prompt_tokens_computed += prompt_tokens
        seq.prompt_tokens_computed += prompt_tokens
        self.kv_manager.commit(seq.kv, seq.token_ids, seq.num_computed_tokens)
        return seq.num_computed_tokens == seq.num_tokens

    def _track_kv_utilisation(self, seqs: list[Sequence], num_new: list[int]) -> None:
        self.stats.kv_tokens_stored += sum(
            seq.num_computed_tokens + n for seq, n in zip(seqs, num_new, strict=True)
        )
        self.stats.kv_slots_allocated += (
            sum(len(s.kv.block_table) for s in seqs) * self.config.block_size
        )

    def _sample_request(self, seq: Sequence, ahead: int = 0) -> SampleRequest:
        """``ahead``: tokens the sequence will have gained before this draw is appended."""
        params = seq.params
        banned: list[int] = []
        if seq.num_output_tokens + ahead < params.min_tokens:
            banned = list(params.stop_token_ids or ()) + (
                [] if params.ignore_eos else self.eos_token_ids
            )
        return SampleRequest(params, seq.generator, banned, seq.request_id)

    def _append_token(self, seq: Sequence, token: int, logprob: float | None, top: Any) -> None:
        params = seq.params
        seq.token_ids.append(token)
        self.stats.generated_tokens += 1
        if top is not None:
            seq.logprobs.append(top)
            seq.cumulative_logprob += logprob or 0.0
        self.kv_manager.update_hashes(seq.kv, seq.token_ids)
        stop_string = seq.detokenizer.append(token) if seq.detokenizer else None
        past_min = seq.num_output_tokens >= params.min_tokens
        if past_min and token in (params.stop_token_ids or ()):
            seq.finish_reason, seq.stop_reason = "stop", token
        elif past_min and not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif past_min and stop_string is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_string
        elif seq.num_output_tokens >= self._max_new_tokens(seq.num_prompt_tokens, params):
            seq.finish_reason = "length"

    def _make_output(self, request: _Request) -> RequestOutput:
        completions = [
            CompletionOutput(
                index=seq.index,
                text=seq.detokenizer.stream_text(seq.is_finished) if seq.detokenizer else "",
                token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                logprobs=list(seq.logprobs) if request.params.logprobs is not None else None,
                cumulative_logprob=seq.cumulative_logprob
                if request.params.logprobs is not None
                else None,
            )
            for seq in request.seqs
        ]
        metrics = {"arrival_time": request.arrival_time}
        cached = max(0, min(seq.num_cached_tokens for seq in request.seqs))
        if request.first_token_time is not None:
            metrics["first_token_time"] = request.first_token_time
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=request.finished,
            num_cached_tokens=cached,
            cached_tokens_by_tier=_by_tier(
                cached, request.seqs[0].kv.loaded_blocks, self.config.block_size
            ),
            metrics=metrics,
        )


def _by_tier(cached: int, loaded_blocks: dict[str, int], block_size: int) -> dict[str, int]:
    """Split ``cached`` prompt tokens into those loaded from each tier and the rest, which
    were on the device already. NOTE: a preempted sequence may load a block twice; the
    split is capped so that it always sums to ``cached``."""
    split: dict[str, int] = {}
    left = cached
    for name, blocks in sorted(loaded_blocks.items()):
        split[name] = min(left, blocks * block_size)
        left -= split[name]
    return {"device": left, **split}


def _restore(requests: list[SampleRequest], states: list[torch.Tensor | None]) -> None:
    for request, state in zip(requests, states, strict=True):
        if request.generator is not None and state is not None:
            request.generator.set_state(state)
