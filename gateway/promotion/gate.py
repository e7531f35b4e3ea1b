"""The promotion gate's rule: is the candidate step not worse than the promoted one, with confidence?

Both steps answer the same scenarios; the gate looks at the per-scenario differences (candidate minus
promoted, each a mean over samples) and passes when the lower end of the Student-t confidence interval of
their mean is above `-margin`. A point estimate would promote a step that looked better by luck; the
interval holds back a step until the eval set is large (or clear) enough to say.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec


def _t_quantile(p: float, df: float) -> float:
    """Student's t quantile. scipy.stats takes ~1.5 s to import: the first evaluation pays it, not every gateway
    start (and so every test's gateway)."""
    from scipy import stats

    return float(stats.t.ppf(p, df))


class GateVerdict(msgspec.Struct, frozen=True):
    scenarios: int
    mean_difference: float  # candidate - promoted, mean over scenarios
    ci_low: float
    ci_high: float
    passed: bool


def paired_gate(
    candidate: Sequence[float], baseline: Sequence[float], *, margin: float, confidence: float
) -> GateVerdict:
    """The verdict on per-scenario mean rewards of the candidate and the promoted step (same order)."""
    if len(candidate) != len(baseline):
        raise ValueError(f"{len(candidate)} candidate scores for {len(baseline)} baseline scores")
    n = len(candidate)
    if n == 0:
        raise ValueError("no scenarios to judge")
    differences = [c - b for c, b in zip(candidate, baseline, strict=True)]
    mean = math.fsum(differences) / n
    if n == 1:  # no spread to judge by: the interval is unbounded and the gate holds
        return GateVerdict(1, mean, -math.inf, math.inf, False)
    variance = math.fsum((d - mean) ** 2 for d in differences) / (n - 1)
    half_width = _t_quantile((1 + confidence) / 2, n - 1) * math.sqrt(variance / n)
    low, high = mean - half_width, mean + half_width
    return GateVerdict(n, mean, low, high, low >= -margin)


def unpaired_gate(
    candidate: Sequence[float], baseline: Sequence[float], *, margin: float, confidence: float
) -> GateVerdict:
    """The verdict on two independent samples of live rewards (a canary's arms): Welch's interval of the
    difference of means, with the Welch-Satterthwaite degrees of freedom. `scenarios`: the smaller arm."""
    n, m = len(candidate), len(baseline)
    if n < 2 or m < 2:
        raise ValueError(f"each arm needs 2 rewards or more, got {n} and {m}")
    mean_c, mean_b = math.fsum(candidate) / n, math.fsum(baseline) / m
    var_c = math.fsum((x - mean_c) ** 2 for x in candidate) / (n - 1)
    var_b = math.fsum((x - mean_b) ** 2 for x in baseline) / (m - 1)
    difference = mean_c - mean_b
    se2 = var_c / n + var_b / m
    if se2 == 0:  # every reward the same in both arms: the difference is exact
        return GateVerdict(min(n, m), difference, difference, difference, difference >= -margin)
    df = se2**2 / ((var_c / n) ** 2 / (n - 1) + (var_b / m) ** 2 / (m - 1))
    half_width = _t_quantile((1 + confidence) / 2, df) * math.sqrt(se2)
    low, high = difference - half_width, difference + half_width
    return GateVerdict(min(n, m), difference, low, high, low >= -margin)
