"""How late the event loop runs: the gateway's tail latency made visible.

Every call is served on one event loop, so anything that holds it (a long computation, a blocking read, a garbage
collection, another thread holding the GIL) delays every call in flight. A probe asks to be woken every
`interval` seconds; how much later it wakes is the loop's lag. `/metrics` exports the longest lag of the last
`window` seconds (`artgw_event_loop_lag_max_seconds`) and every lag in a histogram.

With a profile path (`--loop-profile`), a thread also samples what the loop's thread is running whenever the
probe is late, and writes the samples' shares by place on exit: which cause takes which share of the stalls.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import sys
import threading
import time
import traceback
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge, Histogram

_ROOT = str(Path(__file__).resolve().parents[1]) + "/"  # the checkout: places are named relative to it
STALL = 0.005  # a probe this late (or more) means something held the loop: the profile samples it
_PROJECT = ("gateway/", "store/", "artgw/", "ruler/")


class LoopWatch:
    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        interval: float = 0.025,  # 40 wake-ups a second: ~0.2 % of a core; a stall longer than this is always seen
        window: float = 10.0,
        profile: Path | None = None,
    ) -> None:
        self.interval = interval
        self.window = window
        self.profile = profile
        self._lags: collections.deque[tuple[float, float]] = collections.deque()  # (when, lag) over the window
        self.histogram = Histogram(
            "artgw_event_loop_lag_seconds",
            "How late the event loop woke a probe asking for it every 25 ms: anything that held the loop.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=registry,
        )
        gauge = Gauge(
            "artgw_event_loop_lag_max_seconds",
            "The longest event-loop lag of the last 10 seconds (the tail every call in flight then waited).",
            registry=registry,
        )
        gauge.set_function(self.max_lag)
        self.beat = time.monotonic()  # the probe's last wake-up, read by the profile's sampler
        self.samples: collections.Counter[str] = collections.Counter()
        self.sampled = 0
        self._stop = threading.Event()
        self._sampler: threading.Thread | None = None
        self.gc_seconds: collections.defaultdict[int, float] = collections.defaultdict(float)  # by generation
        self.gc_longest: collections.defaultdict[int, float] = collections.defaultdict(float)  # (while profiling)
        self.gc_runs: collections.Counter[int] = collections.Counter()
        self._gc_started = 0.0

    def max_lag(self) -> float:
        cutoff = time.monotonic() - self.window
        return max((lag for when, lag in self._lags if when >= cutoff), default=0.0)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        if self.profile is not None:
            self._sampler = threading.Thread(
                target=self._sample, args=(threading.main_thread().ident,), name="loop-profile", daemon=True
            )
            self._sampler.start()
            gc.callbacks.append(self._gc)
        try:
            while True:
                asked = loop.time() + self.interval
                await asyncio.sleep(self.interval)
                now = time.monotonic()
                self.beat = now
                lag = max(0.0, loop.time() - asked)
                self.histogram.observe(lag)
                self._lags.append((now, lag))
                while self._lags and self._lags[0][0] < now - self.window:
                    self._lags.popleft()
        finally:
            self._stop.set()
            if self.profile is not None:
                gc.callbacks.remove(self._gc)
                self.write_profile(self.profile)

    def _gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        took = time.perf_counter() - self._gc_started
        self.gc_seconds[info["generation"]] += took
        self.gc_runs[info["generation"]] += 1
        self.gc_longest[info["generation"]] = max(self.gc_longest[info["generation"]], took)

    def _sample(self, loop_thread: int | None) -> None:
        """Every millisecond: if the probe is late, what the loop's thread is running (its innermost frames)."""
        while not self._stop.wait(0.001):
            if time.monotonic() - self.beat < self.interval + STALL:
                continue
            frame = sys._current_frames().get(loop_thread or 0)
            if frame is None:
                continue
            self.sampled += 1
            self.samples[_place(frame)] += 1

    def write_profile(self, path: Path) -> None:
        total = max(self.sampled, 1)
        lines = [f"{self.sampled} samples (1 ms apart) of the loop's thread while the loop was held\n"]
        lines += [f"{100 * n / total:5.1f}%  {n:6d}  {place}\n" for place, n in self.samples.most_common(40)]
        lines += [
            f"gc generation {g}: {self.gc_runs[g]} collections, {self.gc_seconds[g]:.3f} s in all, longest "
            f"{1000 * self.gc_longest[g]:.1f} ms\n"
            for g in sorted(self.gc_seconds)
        ]
        lines.append(f"objects the collector tracks: {len(gc.get_objects())} ({gc.get_freeze_count()} frozen)\n")
        path.write_text("".join(lines))


def _place(frame: object) -> str:
    """Where the loop's thread is: its innermost frame of the project's own code, and the innermost frame of all
    (a library's), as `file:line function`."""
    stack = traceback.extract_stack(frame)  # type: ignore[arg-type]
    innermost = stack[-1]
    ours = next((f for f in reversed(stack) if any(p in f.filename for p in _PROJECT)), innermost)
    where = f"{_short(ours.filename)}:{ours.lineno} {ours.name}"
    if ours is not innermost:
        where += f" <- {_short(innermost.filename)}:{innermost.lineno} {innermost.name}"
    return where


def _short(filename: str) -> str:
    for marker in ("site-packages/", _ROOT, "python3.11/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename
