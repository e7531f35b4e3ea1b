"""Rule checks beside the judge: what rules can check, a rule checks, and the judge never overrides it.

A RULER group may carry `checks`, each one of the eval sets' graders (gateway/promotion/graders.py: `exact`,
`regex`, `json_schema`, `tool_call`, `webhook`) applied to every rollout's final answer (its last assistant
message). A check passes when the grader gives 1 (for a webhook: a reward above 0). A failed check either
zeroes the rollout's reward (`on_fail: "zero"`, the default: a hard check) or takes `weight` off it
(`"subtract"`, never below 0). A check that cannot run (a webhook that keeps failing, or one the operator no
longer allows) counts as failed: an unchecked answer is never let through. A webhook's error says only that it
failed, the why (address, status, reply) goes to the log: any `read` key sees a check's error, and telling a
refused connection from a 401 would map the network behind the gateway for it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

import httpx
import msgspec

from gateway.promotion.graders import (
    Answer,
    EvalScenario,
    ExactGrader,
    GraderFailed,
    JsonSchemaGrader,
    RegexGrader,
    ToolCallGrader,
    WebhookGrader,
    grade,
)
from store.groups import CheckOutcome

log = logging.getLogger("artgw.groups")

CheckGrader = ExactGrader | RegexGrader | JsonSchemaGrader | ToolCallGrader | WebhookGrader
MAX_CHECKS = 16
WEBHOOK_FAILED = "webhook failed (the gateway's log says why)"


class GroupCheck(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One rule check of a RULER group: a grader, and what failing it does to a rollout's reward."""

    grader: CheckGrader
    on_fail: Literal["zero", "subtract"] = "zero"
    weight: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0  # taken off a reward by a failed `subtract` check

    def __post_init__(self) -> None:
        if self.on_fail == "subtract" and self.weight <= 0:
            raise ValueError("a `subtract` check needs a `weight` above 0 (what failing it takes off)")
        if self.on_fail == "zero" and self.weight:
            raise ValueError("`weight` is for `subtract` checks: a failed `zero` check zeroes the reward")


def final_answer(messages: Sequence[dict[str, Any]]) -> Answer:
    """The rollout's last assistant message as a grader reads it (no content and no calls if it has none)."""
    last = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
    if last is None:
        return Answer(content=None)
    return Answer.from_choice({"message": last, "finish_reason": None})


async def run_checks(
    checks: Sequence[GroupCheck],
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    http: httpx.AsyncClient,
    allows_webhook: Callable[[str], bool],
    *,
    index: int,
) -> list[CheckOutcome]:
    """Every check on one rollout (the `index`-th of its group), in the group's order; a webhook only where
    `allows_webhook` (the operator's endpoints)."""
    answer = final_answer(messages)
    outcomes = []
    for check in checks:
        scenario = EvalScenario(
            messages=messages or [{"role": "user", "content": ""}], tools=tools, grader=check.grader
        )
        error = None
        try:
            if isinstance(check.grader, WebhookGrader) and not allows_webhook(check.grader.url):
                raise GraderFailed("its endpoint is not one --group-webhook allows (any more)")
            passed = await grade(check.grader, scenario, answer, http, index=index) > 0
        except GraderFailed as exc:
            passed, error = False, str(exc)[:500]
            if isinstance(check.grader, WebhookGrader):
                log.warning("rollout %d: a group check's webhook failed: %s", index, exc)
                error = WEBHOOK_FAILED
        kind = str(check.grader.__struct_config__.tag)  # the grader's wire `type` (every tag is a string)
        outcomes.append(CheckOutcome(kind, passed, check.on_fail, check.weight, error))
    return outcomes


def checked_reward(score: float, outcomes: Sequence[CheckOutcome]) -> float:
    """The judge's score after the checks: 0 if a `zero` check failed, else less each failed `subtract`
    check's weight (never below 0)."""
    failed = [o for o in outcomes if not o.passed]
    if any(o.on_fail == "zero" for o in failed):
        return 0.0
    return max(0.0, score - math.fsum(o.weight for o in failed))
