"""Admission control at the router: past capacity a request waits its turn, past a bound it gets 503.

The router calls engines directly (not through Serve), so Serve's `max_ongoing_requests` never
protects them; this is where load is bounded. Requests beyond `max_active` wait in FIFO order for
up to `timeout_s`; beyond `max_waiting` waiters, or past the timeout, they are refused with
ServerOverloadedError, which the ingress answers as HTTP 503 with Retry-After. An admitted request
is never affected by the ones refused after it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator


class ServerOverloadedError(RuntimeError):
    """Refused for lack of capacity; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # keep retry_after_s across Ray's pickling
        return (type(self), (str(self), self.retry_after_s))


class Admission:
    """A FIFO counting gate: `async with admission.slot(): ...`."""

    def __init__(self, max_active: int, max_waiting: int, timeout_s: float) -> None:
        self.max_active = max_active
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.num_active = 0
        self.draining = False
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self._acquire()
        try:
            yield
        finally:
            self._release()

    def drain(self) -> None:
        """Refuse every request from now on (the server is stopping); admitted and waiting ones run."""
        self.draining = True

    async def _acquire(self) -> None:
        if self.draining:
            raise ServerOverloadedError("server is shutting down", retry_after_s=5.0)
        if self.num_active < self.max_active and not self._waiters:
            self.num_active += 1
            return
        if len(self._waiters) >= self.max_waiting:
            raise ServerOverloadedError(
                f"server at capacity: {self.num_active} requests running and {len(self._waiters)} waiting")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if waiter.done() and not waiter.cancelled():  # granted just as we gave up: hand it on
                self._release()
            else:
                waiter.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            if isinstance(exc, asyncio.TimeoutError):
                raise ServerOverloadedError(
                    f"server at capacity: no room within {self.timeout_s:.0f} s") from None
            raise

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes straight to the next waiter
                return
        self.num_active -= 1
