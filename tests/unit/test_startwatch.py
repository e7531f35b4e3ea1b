"""The start watcher's judgement (trainer/startwatch.py `stalled_on_memory`) on hand-made samples, one a second:
a parked start and a thrashing one (bursts of user time between its faults) are stalled; a slow but healthy start
(little user time, no faults; or faults with steady user time) is not, and neither is a window not yet long enough.
"""

from __future__ import annotations

import pytest

from trainer.startwatch import TICKS, Sample, said, stalled_on_memory


def samples(
    user_seconds: list[float], faults: list[int], pressure: list[int], parked: list[bool] | None = None
) -> list[Sample]:
    """Cumulative samples 1 s apart from per-second increments (the first sample is the start: all zero)."""
    out = [Sample(0.0, 0, 0, 0, False)]
    for i, (user, fault, stall) in enumerate(zip(user_seconds, faults, pressure, strict=True)):
        last = out[-1]
        park = parked[i] if parked else False
        out.append(
            Sample(
                last.at + 1,
                last.user_ticks + round(user * TICKS),
                last.major_faults + fault,
                last.pressure_us + stall,
                park,
            )
        )
    return out


def test_a_parked_start_is_stalled_on_memory() -> None:
    parked = samples([0.0] * 10, [0] * 10, [0] * 10, [True] * 10)
    assert stalled_on_memory(parked, 10)


def test_a_thrash_with_bursts_of_user_time_is_stalled_on_memory() -> None:
    # Faulting every second under growing pressure; twice a burst of a fifth of a second in user time (the
    # second-by-second judgement this replaces restarted its count at each), 4 % of the window in all.
    user = [0.0, 0.0, 0.2, 0.0, 0.0, 0.0, 0.0, 0.2, 0.0, 0.0]
    thrash = samples(user, [300] * 10, [400_000] * 10)
    assert stalled_on_memory(thrash, 10)
    # parked in some seconds, thrashing in the others: the same stall
    mixed = samples(user, [300, 0] * 5, [400_000] * 10, [False, True] * 5)
    assert stalled_on_memory(mixed, 10)


def test_a_slow_healthy_start_is_not_stalled_on_memory() -> None:
    # Waiting (the disk, the network, a busy machine): little user time and no faults, while others press on memory.
    waiting = samples([0.01] * 10, [0] * 10, [400_000] * 10)
    assert not stalled_on_memory(waiting, 10)
    # Reading its weights from a slow disk: faults in every second, and user time it makes steadily.
    reading = samples([0.1] * 10, [300] * 10, [400_000] * 10)
    assert not stalled_on_memory(reading, 10)
    # Faulting, but no memory pressure at all: pages read for the first time, not thrashed.
    cold = samples([0.0] * 10, [300] * 10, [0] * 10)
    assert not stalled_on_memory(cold, 10)
    # Parked once, then on again.
    once = samples([0.0] * 10, [0] * 10, [0] * 10, [True] + [False] * 9)
    assert not stalled_on_memory(once, 10)


def test_a_window_shorter_than_the_bound_is_not_judged() -> None:
    parked = samples([0.0] * 5, [0] * 5, [0] * 5, [True] * 5)
    assert not stalled_on_memory(parked, 10)
    assert not stalled_on_memory(parked[:1], 0)


def test_the_line_comes_once_after_the_process_is_gone(capfd: pytest.CaptureFixture[str]) -> None:
    looks = iter([False, False, True])
    said(b"stalled\n", lambda: next(looks))
    assert capfd.readouterr().err == "stalled\n"
    said(b"stalled\n", lambda: False, tries=3)  # never seen gone: said all the same, at the end
    assert capfd.readouterr().err == "stalled\n"
