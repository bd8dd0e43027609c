"""The engine: requests in, one schedule → run → postprocess step at a time, outputs out."""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kernels.fp8_kv import kv_format
from kernels.registry import get_backend
from kvstore.block_pool import BlockPool
from kvstore.device_cache import KVCacheSpec
from kvstore.hashing import hash_full_blocks, make_salt
from kvstore.kv_cache_manager import KVAllocation, KVCacheManager
from kvstore.pool_prefault import PoolPrefaulter
from kvstore.segments import Segment, segment_salt
from ragserve.config import EngineConfig
from ragserve.devices import resolve_device
from ragserve.engine.blend_install import BlendInstaller, SegmentWork
from ragserve.engine.blend_requests import (
    SEGMENT_PARAMS,
    BlendRequest,
    segment_request_id,
)
from ragserve.engine.cpu_malloc import keep_freed_memory
from ragserve.engine.detokenizer import IncrementalDetokenizer
from ragserve.engine.engine_face import make_info, take_snapshot
from ragserve.engine.engine_info import EngineSnapshot, KVModel
from ragserve.engine.engine_request import EngineRequest
from ragserve.engine.engine_setup import kv_budget_bytes, open_tiers
from ragserve.engine.guarded_sampling import GuardedSampler, LaunchedStep
from ragserve.engine.model_runner import ModelRunner
from ragserve.engine.prefix_pins import PrefixPins
from ragserve.engine.sampler import SampleRequest, read_samples, to_device_async
from ragserve.engine.scheduler import Scheduler
from ragserve.engine.sequence import Sequence, SequenceStatus
from ragserve.models.loader import LoadedModel, load_model_from_config
from ragserve.outputs import RequestOutput
from ragserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


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


class LLMEngine:
    def __init__(
        self, config: EngineConfig, *, prepare_this_thread: bool = True, offline: bool = False
    ) -> None:
        """``prepare_this_thread=False`` leaves ``prepare_thread`` to the thread that will
        step the engine (``AsyncEngine`` does that). ``offline``: no stream waits on its
        steps (the LLM class), so the step size defaults larger (``EngineConfig.for_device``)."""
        self.config = config
        self.prepared_threads: set[int] = set()
        started = time.perf_counter()
        if resolve_device(config.device).type == "cpu":
            keep_freed_memory()
        self.loaded: LoadedModel = load_model_from_config(config)
        self.device = self.loaded.device
        config = self.config = config.for_device(self.device.type, offline=offline)
        self.dtype = self.loaded.dtype
        self.tokenizer: Any = self.loaded.tokenizer
        self.model_name = self.loaded.name
        self.max_model_len = self.loaded.max_model_len
        self.eos_token_ids = list(self.loaded.eos_token_ids)

        shape = self.loaded.model.shape
        # The salt binds kv_format.name: blocks of different KV formats never mix.
        self.kv_format = kv_format(config.kv_cache_dtype, self.dtype, shape.head_dim)
        self.kv_spec = KVCacheSpec(
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            row_width=self.kv_format.row_width,
            block_size=config.block_size,
            dtype=self.kv_format.storage_dtype,
        )
        num_blocks = self.kv_spec.num_blocks_for(
            kv_budget_bytes(config, self.device, self.kv_spec.bytes_per_token, self.max_model_len)
        )
        if num_blocks < 1:
            raise ValueError(
                f"the KV budget holds no block of {self.kv_spec.bytes_per_block} bytes; "
                + (
                    "raise kv_cache_gib"
                    if config.kv_cache_gib is not None or self.device.type != "cuda"
                    else "raise gpu_memory_utilization, free the GPU, or give kv_cache_gib"
                )
            )
        self.kv_cache = self.kv_spec.allocate(num_blocks, self.device)
        backend = get_backend(config.attention_backend, self.device, self.kv_format.quantized)
        # NOTE: before the tiers open: a refused cache leaves no worker thread behind.
        backend.check_kv_cache(self.kv_cache)
        self.block_pool = BlockPool(num_blocks)
        # The OS maps a CPU pool's pages lazily: map them before the steps write them.
        self.prefaulter = PoolPrefaulter(self.kv_cache) if self.device.type == "cpu" else None
        self.tiers = open_tiers(config, self.kv_cache, self.block_pool)
        self.kv_manager = KVCacheManager(
            self.block_pool,
            config.block_size,
            config.enable_prefix_caching,
            tiers=self.tiers,
            max_load_bytes_per_step=int(config.kv_load_gib_per_step * 2**30),
        )
        self.scheduler = Scheduler(self.kv_manager, config.step_tokens, config.max_num_seqs)
        self.runner = ModelRunner(
            self.loaded.model, self.kv_cache, backend, config.block_size, self.device
        )
        if self.device.type == "cuda":
            self.runner.warm_up(config.step_tokens, self.max_model_len, num_blocks)
        if self.device.type == "cuda" and backend.supports_cuda_graphs and not config.enforce_eager:
            self.runner.capture_decode_graphs(config.max_num_seqs, self.max_model_len)
        if prepare_this_thread:
            self.prepare_thread()
        self.stats = EngineStats()
        self._requests: dict[str, EngineRequest] = {}
        self._salts: dict[str, bytes] = {}
        self.pins = PrefixPins(self.kv_manager, self.block_pool)
        self.blender = BlendInstaller(
            self.kv_cache,
            self.loaded.model.model.rotary_emb.inv_freq,
            self.kv_manager,
            self._segment_work,
        )
        self._next_seq_id = 0
        async_scheduling = config.async_scheduling
        self.async_scheduling = (
            self.device.type == "cuda" if async_scheduling is None else async_scheduling
        )
        self._lookahead: LaunchedStep | None = None
        # Outputs of requests failed alone during a step, returned with that step's outputs.
        self._failed: list[RequestOutput] = []
        self.sampler = GuardedSampler()
        self.info = make_info(self, backend.name)
        logger.info(
            "engine ready in %.1fs: %s on %s (%s), %d KV blocks of %d tokens (%s, %.2f GiB), "
            "attention %s, decode %s",
            time.perf_counter() - started,
            self.model_name,
            self.device,
            str(self.dtype).removeprefix("torch."),
            num_blocks,
            config.block_size,
            self.kv_format.name,
            num_blocks * self.kv_spec.bytes_per_block / 2**30,
            backend.name,
            "eager" if self.runner.decode_graphs is None else "in CUDA graphs",
        )

    def background_work(self) -> None:
        """Cheap upkeep run before each step and while idle: queue pending disk writes, and
        keep the CPU pool's pages mapped ahead of the blocks in use."""
        if self.tiers is not None:
            self.tiers.drain_backlog()
        if self.prefaulter is not None:
            self.prefaulter.keep_ahead_of(self.block_pool.high_water)

    def shutdown(self) -> None:
        """Abort what is running, then flush queued disk-tier writes and close the tiers."""
        for request_id in list(self._requests):
            self.abort_request(request_id)
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None
        if self.prefaulter is not None:
            self.prefaulter.close()

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
        self.runner.prepare_attention(self.config.step_tokens, min(self.max_model_len, capacity))
        if self.device.type == "cuda":
            logger.info("attention plans built in %.1fs", time.perf_counter() - started)

    @property
    def num_kv_blocks(self) -> int:
        return self.block_pool.num_blocks

    def snapshot(self) -> EngineSnapshot:
        """The engine's counters, copied; call it on the thread that steps the engine."""
        return take_snapshot(self)

    # -- requests ----------------------------------------------------------------------------
    def salt_for(self, namespace: str) -> bytes:
        salt = self._salts.get(namespace)
        if salt is None:
            salt = make_salt(
                self.loaded.fingerprint, self.config.block_size, self.kv_format.name, namespace
            )
            self._salts[namespace] = salt
        return salt

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token id lists")
            return prompt, list(self.tokenizer.encode(prompt))
        try:
            # NOTE: operator.index, not int: 3x faster on a 128k-token prompt, and a float
            # or a string is refused instead of truncated or parsed.
            return None, list(map(operator.index, prompt))
        except TypeError:
            raise ValueError("a prompt of token ids must hold integers only") from None

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        namespace: str = "",
        persist: bool = False,
        documents: Seq[tuple[int, int]] | None = None,
        kv_reuse: str | None = None,
        recompute_ratio: float | None = None,
    ) -> None:
        """Validate and queue one request; raises ValueError with the numbers when it cannot run.

        ``persist`` writes the request's computed blocks through to the disk tier at once.
        ``documents``: the prompt's document spans ``(start, end)`` in token positions, the
        first one right after the fixed template; with ``kv_reuse`` "blend" (default: the
        config's) the KV of later documents is reused from their segments, recomputing
        ``recompute_ratio`` of each (see :mod:`ragserve.engine.blend_requests`).
        """
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.tokenize(prompt)
        id_array = self._validate(token_ids, params)
        blend = BlendRequest.make(
            self.config, self.salt_for(namespace), token_ids, documents, kv_reuse, recompute_ratio
        )
        missing = (
            blend.take_missing_segments(self.kv_manager, self._segment_in_flight)
            if blend is not None
            else []
        )
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
                blend=blend.plan() if blend is not None else None,
            )
            self._next_seq_id += 1
            self.kv_manager.update_hashes(seq.kv, id_array)
            seqs.append(seq)
        self._requests[request_id] = EngineRequest(request_id, text, token_ids, params, seqs, now)
        for seq in seqs:
            self.scheduler.add(seq)
        for segment in missing:
            self._add_segment_request(segment, namespace, persist)

    def _add_segment_request(self, segment: Segment, namespace: str, persist: bool) -> None:
        """Queue the computation of a segment that no cache holds, once, unseen by callers."""
        request_id = segment_request_id(segment)
        if request_id in self._requests:
            return
        tokens = list(segment.token_ids)
        now = time.monotonic()
        seq = Sequence(
            seq_id=self._next_seq_id,
            request_id=request_id,
            index=0,
            token_ids=list(tokens),
            num_prompt_tokens=len(tokens),
            params=SEGMENT_PARAMS,
            kv=KVAllocation(salt=segment.salt, persist=persist),
            detokenizer=None,
            tenant=namespace,
            arrival_time=now,
        )
        self._next_seq_id += 1
        self.kv_manager.update_hashes(seq.kv, seq.token_ids)
        self._requests[request_id] = EngineRequest(
            request_id, None, tokens, SEGMENT_PARAMS, [seq], now, internal=True
        )
        self.scheduler.add(seq)

    def _segment_in_flight(self, segment: Segment) -> bool:
        return segment_request_id(segment) in self._requests

    def _segment_work(self, segment: Segment) -> SegmentWork:
        request = self._requests.get(segment_request_id(segment))
        if request is None:
            return None
        running = any(seq.status is SequenceStatus.RUNNING for seq in request.seqs)
        return "running" if running else "queued"

    def _fresh_seed(self) -> int:
        return (self.config.seed * 1_000_003 + self._next_seq_id) & 0x7FFF_FFFF_FFFF_FFFF

    def _validate(self, token_ids: list[int], params: SamplingParams) -> np.ndarray:
        """Check the request; returns the prompt's ids as an int64 array.

        NOTE: the array serves the range check here and the block hashes after: each pass
        over a 131k-token list in Python costs about 2 ms, on every question on a document.
        """
        if not token_ids:
            raise ValueError("the prompt is empty: it needs at least one token")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is "
                f"{self.max_model_len} (which must leave room for at least one new token)"
            )
        vocab = self.loaded.model.shape.vocab_size
        try:
            ids = np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
        except OverflowError:
            ids = None
        if ids is None or ids.min() < 0 or ids.max() >= vocab:
            bad = [t for t in token_ids if not 0 <= t < vocab]
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
        # NOTE: at least one new token, so a prompt that fills the cache is refused too.
        total = len(token_ids) + max(1, self._max_new_tokens(len(token_ids), params))
        needed = self.kv_manager.blocks_needed(total)
        if needed > self.num_kv_blocks:
            raise ValueError(
                f"the request needs {needed} KV blocks ({total} tokens) but the cache holds "
                f"{self.num_kv_blocks} blocks of {self.config.block_size} tokens; "
                "lower max_tokens or raise kv_cache_gib"
            )
        return ids

    def _max_new_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """``max_tokens``, within the context; without one, up to the context or what one
        sequence can hold in the whole KV cache if that is less (the request could not
        run at all otherwise)."""
        room = self.max_model_len - num_prompt_tokens
        if params.max_tokens is not None:
            return min(room, params.max_tokens)
        return min(room, self.num_kv_blocks * self.config.block_size - num_prompt_tokens)

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

    def abort_internal_requests(self) -> None:
        """Abort the requests the engine queued for itself (documents' segments). For after
        a failed step: no caller fails them, and one the step left half advanced (computed,
        no token drawn) would never finish."""
        internal = [rid for rid, request in self._requests.items() if request.internal]
        for request_id in internal:
            self.abort_request(request_id)

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
        """Keep the cached full blocks of ``token_ids`` from eviction; returns the tokens
        pinned, 0 past the pin budget (see :mod:`ragserve.engine.prefix_pins`)."""
        alloc = KVAllocation(salt=self.salt_for(namespace))
        return self.pins.pin(pin_id, alloc, token_ids, namespace, namespace_share, self.tiers)

    def unpin_prefix(self, pin_id: str) -> bool:
        return self.pins.unpin(pin_id)

    def purge_prefix(
        self,
        token_ids: list[int],
        namespace: str = "",
        keep: list[list[int]] | None = None,
        model: KVModel | None = None,
    ) -> dict[str, int]:
        """Remove the cached full blocks of ``token_ids`` for good: from the prefix cache
        (without demoting them) and every tier, with every block that follows them in a
        chain; blocks that a sequence of ``keep`` (same namespace) also has stay.

        Returns blocks removed: ``device`` (prefix-cache entries) and one count per tier.
        Unpin first: a pinned block stays with its pin, only unindexed. Requests added
        before this call run on, but never index or persist the purged blocks (commands
        run in order, so every request queued before the purge is among them).

        ``model``: purge the blocks another model wrote (in the tiers it shares with this
        one, e.g. the disk directory) instead of this model's."""
        return self.purge_prefixes([token_ids], namespace, keep, model)

    def purge_prefixes(
        self,
        sequences: list[list[int]],
        namespace: str = "",
        keep: list[list[int]] | None = None,
        model: KVModel | None = None,
    ) -> dict[str, int]:
        """``purge_prefix`` for several sequences in one pass: the kept blocks are hashed
        and the cached links read once, however many sequences go."""
        if model is None:
            salt, size = self.salt_for(namespace), self.config.block_size
            live = [s.kv for r in self._requests.values() for s in r.seqs if not s.is_finished]
        else:
            salt = make_salt(model.fingerprint, model.block_size, model.kv_dtype, namespace)
            size, live = model.block_size, []
        total: dict[str, int] = {}
        # NOTE: a document's segment is the same tokens in the segment domain: it goes too.
        for domain in (salt, segment_salt(salt)):
            owned = [h for seq in sequences for h in hash_full_blocks(domain, seq, size)]
            kept = {h for other in keep or () for h in hash_full_blocks(domain, other, size)}
            counts = self.kv_manager.purge(domain, owned, kept, live)
            for place, removed in {"device": counts.device, **counts.tiers}.items():
                total[place] = total.get(place, 0) + removed
        return total

    def locate_prefix(self, token_ids: list[int], namespace: str = "") -> dict[str, int]:
        """Full blocks of ``token_ids`` held now: ``device`` and one count per tier."""
        salt = self.salt_for(namespace)
        hashes = hash_full_blocks(salt, token_ids, self.config.block_size)
        return self.kv_manager.locate(salt, hashes)

    def kv_usage(self) -> dict[str, int]:
        """Device blocks: total, in use by requests, pinned, cached (indexed), free."""
        pool = self.block_pool
        pinned = len(self.pins.blocks())
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
            # NOTE: the sequence that did not fit, not the head of the queue: another
            # tenant's request may be first in turn and fit once that one is gone.
            stuck = self.scheduler.short_of_blocks or self.scheduler.waiting.peek()
            if stuck is not None and not self.scheduler.running:
                return [*self._take_failed(), self._reject_unschedulable(stuck)]
            return self._take_failed()
        if self._may_look_ahead(launched):
            self._lookahead = self._launch_lookahead(launched)
        outputs = self._finish(launched)
        return [*self._take_failed(), *outputs]

    def _map_new_blocks(self) -> None:
        """Map the CPU pool's pages of the blocks this step was given, before it writes them."""
        if self.prefaulter is not None:
            self.prefaulter.map_through(self.block_pool.high_water)

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
        output = request.safe_output(self.config.block_size)
        output.finished = True
        output.error = message
        output.error_code = "request_failed"
        self.abort_request(request_id)
        self._failed.append(output)

    def _launch_scheduled(self) -> LaunchedStep | None:
        self.blender.install_ready(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch:
            return None
        self._map_new_blocks()
        logits = self.runner.execute(batch.seqs, batch.num_new_tokens)
        self.stats.steps += 1
        self._track_kv_utilisation(batch.seqs, batch.num_new_tokens)
        sampling = [
            seq
            for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True)
            if self._advance(seq, num_new)
        ]
        return self._sample(logits, sampling)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], ahead: int = 0) -> LaunchedStep:
        """Draw a token for each row of ``logits`` (row ``i`` is ``seqs[i]``); a request
        whose draw raises fails alone."""
        requests = [self._sample_request(seq, ahead) for seq in seqs]
        return self.sampler.sample(logits, seqs, requests, self._fail_request)

    def _take_lookahead(self) -> LaunchedStep | None:
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
        return LaunchedStep(seqs, ahead.samples, [ahead.row(index) for index in keep])

    def _may_look_ahead(self, launched: LaunchedStep) -> bool:
        """Steady decoding: every running sequence samples now and nobody waits to join."""
        return (
            self.async_scheduling
            and launched.samples is not None
            and not self.scheduler.waiting
            and len(launched.seqs) == len(self.scheduler.running)
            and all(seq.params.logprobs is None for seq in launched.seqs)
        )

    def _launch_lookahead(self, launched: LaunchedStep) -> LaunchedStep | None:
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
        self._map_new_blocks()
        logits = self.runner.execute(seqs, [1] * len(seqs), next_token_ids=token_ids)
        ahead = self._sample(logits, seqs, ahead=1)
        return ahead if ahead.samples is not None else None

    def _finish(self, launched: LaunchedStep) -> list[RequestOutput]:
        """Read the step's tokens (the host sync) and advance its sequences and requests."""
        results = read_samples(launched.samples) if launched.samples is not None else []
        now = time.monotonic()
        touched: dict[str, EngineRequest] = {}
        for index, seq in enumerate(launched.seqs):
            request = self._requests.get(seq.request_id)
            if request is None or seq.is_finished:
                continue  # failed alone earlier in this step
            touched[seq.request_id] = request
            if seq.num_cached_tokens < 0:
                blended = seq.blend.blended_tokens if seq.blend is not None else 0
                seq.num_cached_tokens = max(
                    0, seq.num_prompt_tokens - seq.prompt_tokens_computed - blended
                )
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
            if request.internal:
                if request.finished:
                    del self._requests[request.request_id]
                continue
            try:
                output = request.output(self.config.block_size)
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
        """Nothing runs and ``seq`` still cannot get its blocks: fail its request alone, or,
        a sequence without ``max_tokens`` that has generated tokens, finish it (length; the
        other samples of its request go on).

        Validation guarantees a request fits an empty cache, so this happens only while
        pinned documents hold the room it needs.
        """
        request = self._requests[seq.request_id]
        if seq.params.max_tokens is None and seq.num_output_tokens:
            # NOTE: it asked for no limit and had as much as fits beside the pins.
            seq.finish_reason = "length"
            self.scheduler.finish(seq)
            if request.finished:
                del self._requests[seq.request_id]
                self.stats.num_finished += 1
            return request.output(self.config.block_size)
        usage = self.kv_usage()
        output = request.output(self.config.block_size)
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
        past_min = seq.num_output_tokens >= params.min_tokens
        if past_min and token in (params.stop_token_ids or ()):
            # NOTE: its text is left out of the output, as OpenAI and vLLM leave it out.
            seq.finish_reason, seq.stop_reason = "stop", token
            return
        stop_string = seq.detokenizer.append(token, past_min) if seq.detokenizer else None
        if past_min and not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif past_min and stop_string is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_string
        elif seq.num_output_tokens >= self._max_new_tokens(seq.num_prompt_tokens, params):
            seq.finish_reason = "length"
