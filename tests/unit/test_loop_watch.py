"""The event-loop lag probe (gateway/loop_watch.py): a stall shows in its gauge and histogram, and its profile
names the place that held the loop."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from gateway.loop_watch import LoopWatch


def hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # what a blocking call on the event loop does to every call in flight


async def test_a_stall_is_measured_and_its_place_profiled(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    watch = LoopWatch(registry, profile=tmp_path / "loop.txt")
    task = asyncio.create_task(watch.run())
    await asyncio.sleep(0.05)  # on time: no stall yet
    assert watch.max_lag() < 0.03
    hold_the_loop(0.12)
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert 0.1 <= watch.max_lag() < 0.5
    assert registry.get_sample_value("artgw_event_loop_lag_max_seconds") == watch.max_lag()
    assert registry.get_sample_value("artgw_event_loop_lag_seconds_bucket", {"le": "0.1"}) < (
        registry.get_sample_value("artgw_event_loop_lag_seconds_count")
    )
    profile = (tmp_path / "loop.txt").read_text()
    top = profile.splitlines()[1]  # the place with the largest share
    assert "hold_the_loop" in top and "test_loop_watch.py" in top, profile
