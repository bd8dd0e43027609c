"""Admission by expected work: refuse a request (503) before it would wait too long.

Work is counted in tokens of two kinds, because they cost very different times: prompt
tokens to compute (prefill, many per step) and answer tokens to generate (decode, one per
sequence per step, each reading its whole context). A request's estimate is its prompt
less the document prefix it starts with (cached, or being computed by the document's own
ingestion), and ``max_tokens`` × ``n`` answer tokens. The controller keeps the estimates
of everything admitted and not yet done (the *outstanding* work), and learns what a token
of each kind costs on this engine now: over windows of ``window_s`` busy seconds (work
outstanding) it records the busy time ``T`` and the prompt tokens ``P`` really computed
and answer tokens ``D`` really generated, and fits ``T ≈ a·P + b·D`` by least squares
over the last ``num_windows`` windows.

A new request's expected time to finish is the time to get through its tenant's
outstanding prompt work and its own, ``a·(P_tenant + P_new)``, plus the other tenants'
prompt work served meanwhile: the engine shares each step's tokens among tenants in turn,
so each other tenant ``u`` takes ``min(a·P_u, a·(P_tenant + P_new))`` (all its prompt work,
or as much as this tenant's); plus its own answer: ``steps_new`` decode steps, each
costing ``b`` per sequence in the batch it joins (``S_answering + S_new``). Answer tokens
of other requests share those steps rather than wait for each other: a long answer being
generated makes each step of a new request a little dearer, it does not queue in front of
it. With a single tenant the prompt part is all the outstanding prompt work; with several,
one tenant's flood lengthens its own estimate, and another's by at most its own prompt
work per active tenant. A request is refused when the estimate exceeds ``max_queue_seconds``;
with a budget well below the clients' timeout, overload turns into quick 503s (with
``Retry-After``: the seconds over the budget) instead of timeouts.

NOTE: under sustained load each step also carries the answers (and prefill chunks) of
requests admitted after this one, so its latency can exceed the estimate. Hence the
default budget of 20 s for clients that time out after 60 s.

Until ``min_windows`` windows are measured, and whenever nothing is outstanding, every
request is admitted (the request-count limit still applies): a request that is slow on
its own is served on an idle server rather than refused forever.

NOTE: ``b`` is an average over the recent mix of batch sizes: one sequence decoding alone
costs a whole step per token, a batch shares the step, so ``b`` times the batch is the
step's time at the batch sizes measured (and an overestimate for a batch much larger than
those). Under sustained load, which is when admission matters, the windows are from that
load.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

# An answer without max_tokens may run to the end of the context, but most stop far
# earlier; counting the whole context would refuse them on any busy server.
UNBOUNDED_ANSWER_TOKENS = 256
MAX_RETRY_AFTER_S = 60
# NOTE: the least a prompt token costs, as a share of an answer token, where the windows
# measure no cost for prompts (answer tokens took all their time): a lone decode step
# costs about what 20 to 130 prompt tokens of a prefill do (SmolLM2 on 2 CPU cores, the
# 8B shape on a GPU). Priced as an answer token, a prompt-heavy request was refused while
# the engine was only decoding.
LEAST_PROMPT_COST = 1 / 32


@dataclass
class Ticket:
    """The estimated work of one admitted request that is not done yet."""

    prompt_left: int
    answer_left: int
    sequences: int  # answering at once (n, times the prompts)
    tenant: str = ""
    closed: bool = False

    @property
    def answering(self) -> bool:
        """Its prompt is computed and its answer is being generated."""
        return not self.closed and self.prompt_left == 0 and self.answer_left > 0


@dataclass(frozen=True)
class Verdict:
    """Why a request may not be admitted now, and when to retry."""

    expected_s: float
    retry_after_s: int


@dataclass(frozen=True)
class Costs:
    """Seconds per prompt token computed and per answer token generated, as measured."""

    prompt_s: float
    answer_s: float

    def seconds(self, prompt_tokens: float, answer_tokens: float) -> float:
        return self.prompt_s * prompt_tokens + self.answer_s * answer_tokens


class WorkAdmission:
    """Outstanding work and its measured cost; event-loop only (no locking).

    ``max_queue_seconds`` <= 0 turns the check off (the work is still tracked).
    """

    def __init__(
        self,
        max_queue_seconds: float,
        *,
        window_s: float = 2.0,
        num_windows: int = 150,
        min_windows: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s <= 0 or not 1 <= min_windows <= num_windows:
            raise ValueError(
                f"need window_s > 0 and 1 <= min_windows <= num_windows, got {window_s}, "
                f"{min_windows}, {num_windows}"
            )
        self.max_queue_seconds = max_queue_seconds
        self.window_s = window_s
        self.min_windows = min_windows
        self._clock = clock
        self.prompt_outstanding = 0
        self.answer_outstanding = 0
        # Per tenant with outstanding work: [prompt tokens, answer tokens].
        self._by_tenant: dict[str, list[int]] = {}
        self.sequences_answering = 0
        self.prompt_computed = 0  # real work done, ever
        self.answer_generated = 0
        self.busy_s = 0.0  # seconds with work outstanding, ever
        self._last_change = clock()
        self._window = (0.0, 0, 0)  # (busy_s, prompt_computed, answer_generated) at its start
        self._windows: deque[tuple[float, int, int]] = deque(maxlen=num_windows)  # (T, P, D)
        self._costs: Costs | None = None

    @property
    def outstanding(self) -> int:
        return self.prompt_outstanding + self.answer_outstanding

    # -- admission -------------------------------------------------------------------------
    def costs(self) -> Costs | None:
        """The fitted costs; None until ``min_windows`` windows are measured."""
        return self._costs

    def expected_seconds(
        self, prompt_tokens: int = 0, decode_steps: int = 0, sequences: int = 1, tenant: str = ""
    ) -> float | None:
        """Time to finish a new request of ``tenant`` that computes ``prompt_tokens`` and
        generates ``decode_steps`` tokens in each of its ``sequences``: the prompt work
        outstanding shared among tenants in turn, then its decode steps in the batch of
        the sequences answering now (see the module docstring); None while unmeasured."""
        costs = self._costs
        if costs is None:
            return None
        own_prompt = self._by_tenant.get(tenant, (0, 0))[0] + prompt_tokens
        others = sum(
            min(work[0], own_prompt) for other, work in self._by_tenant.items() if other != tenant
        )
        batch = self.sequences_answering + sequences
        return costs.seconds(own_prompt + others, decode_steps * batch)

    def tenant_outstanding(self, tenant: str) -> tuple[int, int]:
        """(prompt tokens, answer tokens) outstanding for ``tenant``."""
        prompt, answer = self._by_tenant.get(tenant, (0, 0))
        return prompt, answer

    @property
    def active_tenants(self) -> int:
        """Tenants with work outstanding."""
        return len(self._by_tenant)

    def drain_seconds(self) -> float | None:
        """Time to finish the outstanding work alone (for metrics); None while unmeasured."""
        if self._costs is None:
            return None
        return self._costs.seconds(self.prompt_outstanding, self.answer_outstanding)

    def check(
        self, prompt_tokens: int, decode_steps: int, sequences: int = 1, tenant: str = ""
    ) -> Verdict | None:
        """None if ``tenant``'s new request may start now, else why not."""
        if self.max_queue_seconds <= 0 or self.outstanding == 0:
            return None
        expected = self.expected_seconds(prompt_tokens, decode_steps, sequences, tenant)
        if expected is None or expected <= self.max_queue_seconds:
            return None
        retry = math.ceil(expected - self.max_queue_seconds)
        return Verdict(expected, min(MAX_RETRY_AFTER_S, max(1, retry)))

    def admit(
        self, prompt_tokens: int, answer_tokens: int, sequences: int = 1, tenant: str = ""
    ) -> Ticket:
        """Count a request's estimate as ``tenant``'s outstanding work (after :meth:`check`
        allowed it)."""
        self._tick()
        ticket = Ticket(max(0, prompt_tokens), max(0, answer_tokens), max(1, sequences), tenant)
        self._count(ticket, ticket.prompt_left, ticket.answer_left)
        if ticket.answering:
            self.sequences_answering += ticket.sequences
        return ticket

    # -- progress --------------------------------------------------------------------------
    def progress(
        self, ticket: Ticket, *, prompt: int = 0, computed: int = 0, generated: int = 0
    ) -> None:
        """``prompt`` tokens of the ticket's prompt estimate are behind it, after the engine
        really computed ``computed`` prompt tokens; ``generated`` answer tokens came out."""
        self._tick()
        self.prompt_computed += max(0, computed)
        self.answer_generated += max(0, generated)
        if not ticket.closed:
            was_answering = ticket.answering
            prompt_done = min(max(0, prompt), ticket.prompt_left)
            answer_done = min(max(0, generated), ticket.answer_left)
            ticket.prompt_left -= prompt_done
            ticket.answer_left -= answer_done
            self._count(ticket, -prompt_done, -answer_done)
            self.sequences_answering += ticket.sequences * (ticket.answering - was_answering)
        self._close_window()

    def release(self, ticket: Ticket) -> None:
        """The request ended (however): drop what is left of its estimate; idempotent."""
        if ticket.closed:
            return
        self._tick()
        if ticket.answering:
            self.sequences_answering -= ticket.sequences
        ticket.closed = True
        self._count(ticket, -ticket.prompt_left, -ticket.answer_left)
        ticket.prompt_left = ticket.answer_left = 0
        assert min(self.prompt_outstanding, self.answer_outstanding, self.sequences_answering) >= 0

    def _count(self, ticket: Ticket, prompt: int, answer: int) -> None:
        """Add to the outstanding work, in total and for the ticket's tenant."""
        self.prompt_outstanding += prompt
        self.answer_outstanding += answer
        work = self._by_tenant.setdefault(ticket.tenant, [0, 0])
        work[0] += prompt
        work[1] += answer
        assert min(work) >= 0
        if work == [0, 0]:
            del self._by_tenant[ticket.tenant]

    # -- measurement -----------------------------------------------------------------------
    def _tick(self) -> None:
        now = self._clock()
        if self.outstanding > 0:
            self.busy_s += now - self._last_change
        self._last_change = now

    def _close_window(self) -> None:
        busy, prompt, answer = self._window
        elapsed = self.busy_s - busy
        if elapsed < self.window_s:
            return
        self._windows.append(
            (elapsed, self.prompt_computed - prompt, self.answer_generated - answer)
        )
        self._window = (self.busy_s, self.prompt_computed, self.answer_generated)
        if len(self._windows) >= self.min_windows:
            self._costs = fit_costs(list(self._windows))


def fit_costs(windows: list[tuple[float, int, int]]) -> Costs | None:
    """Least-squares ``T ≈ a·P + b·D`` over windows ``(T, P, D)``, with ``a, b >= 0``.

    Where the best fit leaves one kind's cost at zero (its tokens vanish in the other's
    time), the other kind alone is fitted, and the unmeasured kind given its least
    plausible cost: a prompt token ``LEAST_PROMPT_COST`` of an answer token, an answer token
    what a prompt token costs.
    When the windows cannot tell the two apart (always the same mix), both kinds cost the
    same: total time over total tokens.
    """
    spp = sum(p * p for _, p, _ in windows)
    sdd = sum(d * d for _, _, d in windows)
    spd = sum(p * d for _, p, d in windows)
    spt = sum(p * t for t, p, _ in windows)
    sdt = sum(d * t for t, _, d in windows)
    det = spp * sdd - spd * spd
    if det > 1e-6 * spp * sdd > 0:
        a = (spt * sdd - sdt * spd) / det
        b = (sdt * spp - spt * spd) / det
        if b <= 0:  # NOTE: prompts alone explain the time
            prompt = spt / spp
            return Costs(prompt, prompt)
        if a <= 0:  # NOTE: answers alone explain the time
            b = sdt / sdd
            return Costs(b * LEAST_PROMPT_COST, b)
        return Costs(a, b)
    tokens = sum(p + d for _, p, d in windows)
    if tokens == 0:
        return None
    per_token = sum(t for t, _, _ in windows) / tokens
    return Costs(per_token, per_token)
