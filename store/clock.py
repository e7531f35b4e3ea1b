"""The time the services read: one object, passed in, so tests move it instead of waiting for it.

Rate limits, the key ring's refresh, the canary watcher and the trainers' leases read it. `SYSTEM_CLOCK` is
the real one; tests give a clock of their own (tests/conftest.py `ManualClock`) and move it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Seconds since the epoch: what is stored (a lease's expiry, a decision's time)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back: for intervals (token buckets)."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Return once `seconds` have passed on this clock: the pace of a background loop."""
        ...


class SystemClock:
    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


SYSTEM_CLOCK: Clock = SystemClock()
