"""How much RULER's prefix dedup saves: judge prompt tokens for groups of multi-turn, tool-using
trajectories that share a long system prompt and history, with and without the dedup; and what k judgements
per group (judges x samples, each sample in its own order: ruler/_panel.py) cost against k naive prompts.

    .venv/bin/python bench/ruler_dedup.py [--groups 5] [--size 8] [--history-turns 6] [--judgements 1,2,4]

Tokens are counted with the tiny model's byte-level BPE tokenizer (built locally: no hub, no network);
the ratio, not the absolute count, is the figure that carries over to a real judge's tokenizer.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from artgw.tiny_model import build_tiny_model
from ruler import DEFAULT_RUBRIC, Trajectory, build_judge_messages, orders

SYSTEM = (
    "You are a travel assistant for a large agency. Follow the booking policy strictly: confirm dates, "
    "check the customer's loyalty tier, never book non-refundable fares without explicit consent, quote "
    "prices in the customer's currency, and use the tools to look up flights, hotels and weather. "
) * 6
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} lookup",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "date": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
    for name in ("search_flights", "search_hotels", "get_weather", "get_loyalty_tier")
]


def tool_turn(rng: random.Random, i: int, call_id: str) -> list[dict]:
    tool = rng.choice(TOOLS)["function"]["name"]
    args = json.dumps({"query": f"city {rng.randint(1, 50)}", "date": f"2026-12-{rng.randint(1, 28):02d}"})
    return [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": tool, "arguments": args}}],
        },
        {
            "role": "tool",
            "tool_call_id": call_id,
            "content": json.dumps(
                {"results": [{"name": f"option {k}", "price": rng.randint(80, 900)} for k in range(4)]}
            ),
        },
    ]


def make_group(rng: random.Random, size: int, history_turns: int) -> list[Trajectory]:
    history: list[dict] = [{"role": "system", "content": SYSTEM}]
    for t in range(history_turns):
        history.append({"role": "user", "content": f"Turn {t}: I also need something for day {t}, please."})
        history += tool_turn(rng, t, f"h{t}")
        history.append({"role": "assistant", "content": f"Noted for day {t}: I found four options."})
    history.append({"role": "user", "content": "Now book the cheapest refundable option and summarise."})
    group = []
    for k in range(size):  # each attempt diverges after the shared history
        attempt = [*history, *tool_turn(rng, 99, f"a{k}")]
        attempt.append({"role": "assistant", "content": f"Attempt {k}: booked option {rng.randint(0, 3)}."})
        group.append(Trajectory(messages=attempt, tools=TOOLS))
    return group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=5, help="groups to build (default 5)")
    parser.add_argument("--size", type=int, default=8, help="trajectories per group (default 8)")
    parser.add_argument("--history-turns", type=int, default=6, help="shared turns before they diverge (default 6)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--judgements", default="1,2,4", help="judgements per group to price, comma-separated (default 1,2,4)"
    )
    args = parser.parse_args()
    counts = [int(k) for k in args.judgements.split(",")]

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(Path(tmp) / "tiny"), model_max_length=10**9)
    rng = random.Random(args.seed)

    def tokens(messages: list[dict[str, str]]) -> int:
        return sum(len(tokenizer.encode(m["content"])) for m in messages)

    table = Table("group", "trajectories", "naive tokens", "dedup tokens", "ratio", title="RULER judge prompt tokens")
    panel = Table(
        "judgements k",
        "naive tokens (k prompts)",
        "panel tokens (k orders)",
        "naive / panel",
        "panel / (k x one dedup prompt)",
        title=f"k judgements per group, {args.groups} groups",
    )
    total_naive = total_dedup = 0
    groups = [make_group(rng, args.size, args.history_turns) for _ in range(args.groups)]
    for g, group in enumerate(groups):
        naive = tokens(build_judge_messages(group, DEFAULT_RUBRIC, share_prefix=False))
        dedup = tokens(build_judge_messages(group, DEFAULT_RUBRIC))
        total_naive += naive
        total_dedup += dedup
        table.add_row(str(g), str(len(group)), f"{naive:,}", f"{dedup:,}", f"{naive / dedup:.2f}x")
    table.add_row(
        "all", str(args.groups * args.size), f"{total_naive:,}", f"{total_dedup:,}", f"{total_naive / total_dedup:.2f}x"
    )
    for k in counts:
        # Each judgement shows the group in its own order (distinct prompts; the same order twice is asked once).
        shown = [
            [group[i] for i in order]
            for g, group in enumerate(groups)
            for order in {tuple(o): o for o in orders(len(group), k, f"g-{g}")}.values()
        ]
        spent = sum(tokens(build_judge_messages(trajectories, DEFAULT_RUBRIC)) for trajectories in shown)
        naive_k = k * total_naive
        share = spent / (k * total_dedup)
        panel.add_row(str(k), f"{naive_k:,}", f"{spent:,}", f"{naive_k / spent:.2f}x", f"{share:.3f}")
    console = Console()
    console.print(table)
    console.print(panel)


if __name__ == "__main__":
    main()
