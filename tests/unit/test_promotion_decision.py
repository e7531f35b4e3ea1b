"""The one promotion decision (gateway/promotion/decision.py): each path's evidence in, the decision out; and no
path that moves `NAME` decides or records on its own (checked on the source)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gateway.promotion.decision import (
    AdminAsked,
    CanaryJudged,
    Committed,
    Decision,
    Evaluated,
    LiveWatched,
    decide,
)
from gateway.promotion.gate import GateVerdict
from store.promotions import EvaluationRow

ROOT = Path(__file__).resolve().parents[2]


def evaluation(eval_set: str, status: str, mean: float = 0.8, baseline_mean: float = 0.6) -> EvaluationRow:
    return EvaluationRow(
        model="m",
        step=4,
        eval_set=eval_set,
        status=status,  # type: ignore[arg-type]  # the test passes the states as the store writes them
        scores=None,
        mean=mean,
        baseline_step=3,
        baseline_mean=baseline_mean,
        ci_low=0.05,
        ci_high=0.35,
        margin=0.0,
        error=None,
        created_at=0.0,
        finished_at=1.0,
    )


def verdict(passed: bool, low: float, high: float) -> GateVerdict:
    return GateVerdict(scenarios=10, mean_difference=(low + high) / 2, ci_low=low, ci_high=high, passed=passed)


# ---------------------------------------------------------------- a committed step


def test_always_promotes_every_committed_step() -> None:
    assert decide(Committed(7, "always")) == Decision(
        "promote", 7, "always", "--promotion always: every committed step"
    )


def test_gated_sends_a_committed_step_to_the_gate() -> None:
    decision = decide(Committed(7, "gated"))
    assert (decision.kind, decision.step, decision.actor, decision.moves) == ("evaluate", 7, "gate", False)


# ---------------------------------------------------------------- the gate


def test_the_gate_promotes_a_step_that_passes_every_set() -> None:
    results = (evaluation("math", "passed"), evaluation("tools", "passed", 0.5, 0.5))
    decision = decide(Evaluated(4, 3, 3, results, canary=False))
    assert (decision.kind, decision.step, decision.actor) == ("promote", 4, "gate")
    assert decision.reason == (
        "passed the gate against step 3: math: 0.800 vs 0.600, CI [+0.050, +0.350]; "
        "tools: 0.500 vs 0.500, CI [+0.050, +0.350]"
    )


def test_the_gate_holds_a_step_that_fails_one_set() -> None:
    results = (evaluation("math", "passed"), evaluation("tools", "failed"), evaluation("chat", "error"))
    decision = decide(Evaluated(4, 3, 3, results, canary=True))
    assert (decision.kind, decision.moves) == ("hold", False)
    assert decision.reason == "held back against step 3 (tools: failed, chat: error)"


def test_the_gate_holds_without_eval_sets_or_canary() -> None:
    assert decide(Evaluated(4, 3, 3, (), canary=False)).kind == "hold"


def test_a_step_promoted_during_the_evaluation_is_judged_again() -> None:
    decision = decide(Evaluated(4, 3, 2, (evaluation("math", "passed"),), canary=False))
    assert (decision.kind, decision.step) == ("evaluate", 4)


@pytest.mark.parametrize("sets", [(), (evaluation("math", "passed"),)])
def test_with_a_canary_share_the_gate_starts_a_canary(sets: tuple[EvaluationRow, ...]) -> None:
    decision = decide(Evaluated(4, 3, 3, sets, canary=True))
    assert (decision.kind, decision.step, decision.moves) == ("start_canary", 4, False)


# ---------------------------------------------------------------- the canary and the live watch


def test_a_canary_that_passes_is_promoted() -> None:
    decision = decide(CanaryJudged(4, 3, 3, verdict(True, -0.01, 0.2), 40, 0.7, 38, 0.6))
    assert (decision.kind, decision.step, decision.actor) == ("promote", 4, "canary")
    assert decision.reason == "canary: 40 rewarded rollouts 0.700 vs 38 of step 3 0.600, CI [-0.010, +0.200]"


def test_a_canary_that_fails_is_dropped() -> None:
    decision = decide(CanaryJudged(4, 3, 3, verdict(False, -0.3, -0.1), 40, 0.4, 38, 0.6))
    assert (decision.kind, decision.moves) == ("hold", False)


def test_a_canary_passed_after_an_admin_moved_the_model_is_dropped() -> None:
    decision = decide(CanaryJudged(4, 3, 2, verdict(True, 0.0, 0.2), 40, 0.7, 38, 0.6))
    assert decision.kind == "hold"
    assert decision.reason.endswith("; step 2 was promoted meanwhile")


def test_the_live_watch_rolls_back_a_step_clearly_worse() -> None:
    decision = decide(LiveWatched(5, 4, verdict(False, -0.4, -0.2), 0.05, 30, 0.3, 60, 0.6))
    assert (decision.kind, decision.step, decision.actor) == ("rollback", 4, "canary")
    assert decision.reason == "live reward fell: 30 rollouts 0.300 vs step 4's 0.600, CI [-0.400, -0.200]"


def test_the_live_watch_keeps_a_step_within_the_margin() -> None:
    # The interval's top, -0.04, is above -margin (-0.05): not clearly worse.
    decision = decide(LiveWatched(5, 4, verdict(False, -0.3, -0.04), 0.05, 30, 0.45, 60, 0.6))
    assert (decision.kind, decision.step, decision.moves) == ("hold", 5, False)


# ---------------------------------------------------------------- an admin


@pytest.mark.parametrize(("action", "reason", "recorded"), [("promote", None, "by hand"), ("rollback", "bad", "bad")])
def test_an_admin_is_done_as_asked(action: str, reason: str | None, recorded: str) -> None:
    decision = decide(AdminAsked(action, 2, reason))  # type: ignore[arg-type]  # both Literal values, parametrized
    assert decision == Decision(action, 2, "admin", recorded)  # type: ignore[arg-type]
    assert decision.moves


# ---------------------------------------------------------------- one place


def _calls(name: str) -> list[str]:
    """Where in gateway/ a function named `name` is called: 'module:function' of each call site."""
    found = []
    for path in sorted((ROOT / "gateway").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Call):
                    callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                    if callee == name:
                        found.append(f"{path.relative_to(ROOT).with_suffix('')}:{function.name}")
    return sorted(set(found))


def test_only_the_decision_module_makes_decisions() -> None:
    assert _calls("Decision") == ["gateway/promotion/decision:decide"]


def test_a_promotion_is_recorded_in_one_place() -> None:
    """Every move of `NAME` is recorded by one helper, from the decision it carries (gateway/adapters.py)."""
    assert _calls("record_promotion") == ["gateway/adapters:_record"]


def test_every_path_that_moves_a_model_hands_over_a_decision() -> None:
    """The admin API, the gate, the canary and the live watch call AdapterService.promote, which takes only a
    Decision; --promotion always records in the commit (AdapterService.load), from `decide` too."""
    assert _calls("promote") == [
        "gateway/art_api:promote_step",
        "gateway/art_api:rollback_step",
        "gateway/promotion/service:_check_rollback",
        "gateway/promotion/service:_decide_canary",
        "gateway/promotion/service:evaluate",
    ]
    assert "gateway/adapters:load" in _calls("decide")
    assert _calls("_record") == ["gateway/adapters:load", "gateway/adapters:promote"]
