"""Who decides a promotion: `decide`, one pure function for every path that can change what `NAME` serves.

Each path gathers its evidence and acts on the `Decision` it gets back; none decides on its own:

- a step committed (`Committed`): `--promotion always` promotes it at once (in the commit's own transaction,
  gateway/adapters.py), `gated` sends it to the gate;
- the gate's evaluations of a step (`Evaluated`, gateway/promotion/service.py): promote, start a canary, or hold;
- a canary's live rewards (`CanaryJudged`): promote the candidate or drop it;
- the live watch on a promoted step (`LiveWatched`): roll back to the step before it, or keep it;
- an admin's `promote` / `rollback` (`AdminAsked`, gateway/art_api.py): done as asked.

What serves changes only through `AdapterService.promote(name, decision)`, which records the decision (actor and
reason) with the move; the statistical rules themselves are gateway/promotion/gate.py.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from gateway.promotion.gate import GateVerdict
from store.promotions import EvaluationRow
from store.types import Promotion, PromotionActor

DecisionKind = Literal["promote", "rollback", "start_canary", "evaluate", "hold"]


class Decision(msgspec.Struct, frozen=True):
    """What happens to `step`: serve it (`promote`, `rollback`), give it the canary share of live traffic, send
    it to the gate, or nothing (`hold`: the reason says why)."""

    kind: DecisionKind
    step: int
    actor: PromotionActor
    reason: str

    @property
    def moves(self) -> bool:
        """Does `NAME` serve another step after it?"""
        return self.kind in ("promote", "rollback")


class Committed(msgspec.Struct, frozen=True):
    """The trainer committed `step` under the gateway's `--promotion` policy."""

    step: int
    policy: Promotion


class Evaluated(msgspec.Struct, frozen=True):
    """The gate evaluated `step` against `baseline` (the step served when it began) on every eval set."""

    step: int
    baseline: int
    served_now: int  # what `NAME` serves now: an admin may have moved it during the evaluation
    results: tuple[EvaluationRow, ...]  # one per eval set: only "passed" on every set lets a step through
    canary: bool  # --canary-share > 0: live traffic has the last word


class CanaryJudged(msgspec.Struct, frozen=True):
    """A canary's two arms have their rewards: `verdict` is the candidate against the baseline step."""

    step: int
    baseline: int
    served_now: int
    verdict: GateVerdict
    candidate_rewards: int
    candidate_mean: float
    baseline_rewards: int
    baseline_mean: float


class LiveWatched(msgspec.Struct, frozen=True):
    """The promoted step `current`, with its live rewards since it was promoted, against the step before it."""

    current: int
    previous: int
    verdict: GateVerdict
    margin: float
    current_rewards: int
    current_mean: float
    previous_rewards: int
    previous_mean: float


class AdminAsked(msgspec.Struct, frozen=True):
    """An admin's `POST /v1/art/models/{name}/promote` or `.../rollback` to `step`."""

    action: Literal["promote", "rollback"]
    step: int
    reason: str | None


Evidence = Committed | Evaluated | CanaryJudged | LiveWatched | AdminAsked


def _interval(low: float | None, high: float | None) -> str:
    return f"CI [{low:+.3f}, {high:+.3f}]" if low is not None and high is not None else "no interval"


def decide(evidence: Evidence) -> Decision:
    """The one promotion decision."""
    match evidence:
        case Committed(step=step, policy="always"):
            return Decision("promote", step, "always", "--promotion always: every committed step")
        case Committed(step=step):
            return Decision("evaluate", step, "gate", "--promotion gated: the gate evaluates every committed step")
        case Evaluated(step=step, results=(), canary=False):
            return Decision("hold", step, "gate", "gated promotion and no eval set (POST .../evals)")
        case Evaluated(step=step, results=results) if any(r.status != "passed" for r in results):
            held = ", ".join(f"{r.eval_set}: {r.status}" for r in results if r.status != "passed")
            return Decision("hold", step, "gate", f"held back against step {evidence.baseline} ({held})")
        case Evaluated(step=step, baseline=baseline, served_now=served) if served != baseline:
            return Decision("evaluate", step, "gate", f"step {served} was promoted meanwhile: judged again")
        case Evaluated(step=step, baseline=baseline, canary=True):
            return Decision("start_canary", step, "gate", f"passed the gate against step {baseline}: canary")
        case Evaluated(step=step, baseline=baseline, results=results):
            summary = "; ".join(
                f"{r.eval_set}: {r.mean:.3f} vs {r.baseline_mean:.3f}, {_interval(r.ci_low, r.ci_high)}"
                for r in results
            )
            return Decision("promote", step, "gate", f"passed the gate against step {baseline}: {summary}")
        case CanaryJudged(step=step, baseline=baseline, verdict=verdict):
            reason = (
                f"canary: {evidence.candidate_rewards} rewarded rollouts {evidence.candidate_mean:.3f} vs "
                f"{evidence.baseline_rewards} of step {baseline} {evidence.baseline_mean:.3f}, "
                f"{_interval(verdict.ci_low, verdict.ci_high)}"
            )
            if verdict.passed and evidence.served_now == baseline:
                return Decision("promote", step, "canary", reason)
            if verdict.passed:
                reason += f"; step {evidence.served_now} was promoted meanwhile"
            return Decision("hold", step, "canary", reason)
        case LiveWatched(current=current, previous=previous, verdict=verdict):
            if verdict.ci_high < -evidence.margin:
                reason = (
                    f"live reward fell: {evidence.current_rewards} rollouts {evidence.current_mean:.3f} vs step "
                    f"{previous}'s {evidence.previous_mean:.3f}, {_interval(verdict.ci_low, verdict.ci_high)}"
                )
                return Decision("rollback", previous, "canary", reason)
            return Decision("hold", current, "canary", f"live reward of step {current} holds up")
        case AdminAsked(action=action, step=step, reason=reason):
            return Decision(action, step, "admin", reason or "by hand")
    raise TypeError(f"no promotion decision for {type(evidence).__name__}")
