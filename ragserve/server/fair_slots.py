"""A fixed number of slots shared among tenants in turn (e.g. summarization jobs running)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class TenantSlots:
    """At most ``size`` holders. A freed slot goes to the waiting tenants in turn, and to a
    tenant's waiters in arrival order: a tenant that queued many waiters delays another
    tenant's next one by at most one slot hand-over per waiting tenant.

    Event-loop only. Invariant: a tenant is in the rotation exactly when it has waiters;
    ``free > 0`` only while nobody waits.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.free = size
        self._waiters: dict[str, deque[asyncio.Future[None]]] = {}
        self._turns: deque[str] = deque()

    def waiting(self, tenant: str) -> int:
        return len(self._waiters.get(tenant, ()))

    async def acquire(self, tenant: str) -> None:
        if self.free and not self._turns:
            self.free -= 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if tenant not in self._waiters:
            self._waiters[tenant] = deque()
            self._turns.append(tenant)
        self._waiters[tenant].append(future)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # NOTE: handed over just before the cancellation landed
            else:
                self._forget(tenant, future)
            raise

    def release(self) -> None:
        while self._turns:
            tenant = self._turns.popleft()
            queue = self._waiters[tenant]
            future = queue.popleft()
            if queue:
                self._turns.append(tenant)
            else:
                del self._waiters[tenant]
            if not future.done():
                future.set_result(None)
                return
        self.free += 1

    @asynccontextmanager
    async def hold(self, tenant: str) -> AsyncIterator[None]:
        await self.acquire(tenant)
        try:
            yield
        finally:
            self.release()

    def _forget(self, tenant: str, future: asyncio.Future[None]) -> None:
        queue = self._waiters.get(tenant)
        if queue is None or future not in queue:
            return
        queue.remove(future)
        if not queue:
            del self._waiters[tenant]
            self._turns.remove(tenant)
