#!/usr/bin/env python3
"""The anchor (issue 43): the real model's demo task trained by ART Gateway's loop and by TRL's GRPOTrainer, side
by side on this CPU: held-out reward against wall-clock time, and each one's peak memory.

The same model (SmolLM2-135M-Instruct, `artgw real-model`), task and reward (`artgw.real_task`, the JSON answer
an enum of the allowed values: 1.0 if right), group size, questions a step, LoRA rank and alpha, learning rate,
temperature 1 and held-out questions. What differs is what each one is:

- artgw: `artgw demo --model smollm2` (artgw/demo.py): vLLM on CPU samples under the schema's grammar through the
  gateway, the trainer (`artgw train`, its own process) takes GRPO steps on the recorded tokens, scored under the
  same grammar's masks, and the gateway hot-loads each step. Memory: the peak of the summed RSS of the processes
  it starts (gateway, vLLM, trainer) and the demo itself.
- TRL: `trl.GRPOTrainer` in one process, sampling with transformers' `generate` (TRL's default without a vLLM
  server), constrained by the same schema with xgrammar's transformers logits processor (without it the model
  writes prose, not an answer), and training on the unmasked distribution, as TRL does. Memory: its peak RSS.

Held-out reward: the mean reward of `--eval-samples` samples (T=1) of each of `--eval-scenarios` held-out
questions, before training and every `--eval-every` steps, with each one's 95 % interval.

    nice -n 5 .venv/bin/python bench/trl_compare.py --minutes 6 --model-dir /var/tmp/smollm2   # ~16 min here
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from artgw import real_task
from artgw.demo import DemoConfig, mean_interval


@dataclass
class Point:
    step: int
    seconds: float  # since training started (the first held-out evaluation ends there)
    reward: float
    interval: tuple[float, float]


@dataclass
class Run:
    name: str
    points: list[Point] = field(default_factory=list)
    steps: int = 0
    train_seconds: float = 0.0
    peak_rss_mb: float = 0.0


# -----------------------------------------------------------------------------
# TRL


def _constrained_generate(model: Any, tokenizer: Any, by_prompt: dict[str, real_task.Question]) -> None:
    """Make `model.generate` sample each row under its question's JSON schema (xgrammar, as vLLM does)."""
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model.config.vocab_size)
    compiler = xgr.GrammarCompiler(info)
    compiled: dict[str, Any] = {}
    original = model.generate

    def grammar(prompt: str) -> Any:
        question = next(q for text, q in by_prompt.items() if text in prompt)
        schema = json.dumps(real_task.request(question)["response_format"]["json_schema"]["schema"])
        if schema not in compiled:
            compiled[schema] = compiler.compile_json_schema(schema)
        return compiled[schema]

    def generate(*args: Any, **kwargs: Any) -> Any:
        prompts = tokenizer.batch_decode(kwargs["input_ids"], skip_special_tokens=True)
        kwargs["logits_processor"] = [LogitsProcessor([grammar(p) for p in prompts])]
        return original(*args, **kwargs)

    model.generate = generate


def _held_out_trl(model: Any, tokenizer: Any, questions: list[real_task.Question], samples: int) -> list[float]:
    """Each question's mean reward over `samples` constrained samples at temperature 1 (the model's own generate)."""
    import torch

    means = []
    with torch.no_grad():
        for q in questions:
            text = tokenizer.apply_chat_template(
                real_task.request(q)["messages"], add_generation_prompt=True, tokenize=False
            )
            inputs = tokenizer([text] * samples, return_tensors="pt", padding=True)
            out = model.generate(
                **inputs, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=real_task.MAX_TOKENS
            )
            answers = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
            means.append(statistics.fmean(float(real_task.parse_answer(a, q) == q.correct) for a in answers))
    return means


def run_trl(args: argparse.Namespace, config: DemoConfig) -> Run:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(config.seed)
    run = Run("TRL GRPOTrainer")
    train = real_task.questions(config.task, "train", config.steps * config.groups_per_step, seed=config.seed)
    held_out = real_task.questions(config.task, "heldout", config.eval_scenarios, seed=config.seed)
    by_prompt = {q.question: q for q in train + held_out}
    dataset = Dataset.from_list(
        [{"prompt": real_task.request(q)["messages"], "question_id": q.question} for q in train]
    )

    def reward(completions: list[Any], question_id: list[str], **_: Any) -> list[float]:
        return [
            float(real_task.parse_answer(c[0]["content"], by_prompt[q]) == by_prompt[q].correct)
            for c, q in zip(completions, question_id, strict=True)
        ]

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    _constrained_generate(model, tokenizer, by_prompt)
    out = Path(tempfile.mkdtemp(prefix="artgw-trl-"))
    grpo = GRPOConfig(
        output_dir=str(out),
        learning_rate=config.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta2=0.99,  # artgw train's
        max_grad_norm=1.0,
        num_generations=config.attempts,
        per_device_train_batch_size=config.attempts * config.groups_per_step,
        max_steps=config.steps,
        max_completion_length=real_task.MAX_TOKENS,
        temperature=1.0,
        top_k=0,
        beta=0.0,
        loss_type="grpo",
        scale_rewards="group",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=config.seed,
        disable_tqdm=True,
        shuffle_dataset=False,
    )
    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        task_type="CAUSAL_LM",
    )
    started = [0.0]

    def evaluate(step: int, policy: Any) -> None:
        policy.eval()
        means = _held_out_trl(policy, tokenizer, held_out, config.eval_samples)
        policy.train()
        point = Point(step, time.monotonic() - started[0], statistics.fmean(means), mean_interval(means))
        run.points.append(point)
        print(f"TRL step {step}: held-out {point.reward:.3f} at {point.seconds:.0f}s", flush=True)

    class Eval(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, _args: Any, state: Any, control: Any, model: Any = None, **_: Any) -> Any:
            run.steps = state.global_step
            over = time.monotonic() - started[0] > args.minutes * 60
            if over or state.global_step % config.eval_every == 0 or state.global_step == config.steps:
                evaluate(state.global_step, model)
            if over:
                control.should_training_stop = True
            return control

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=grpo,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[Eval()],
    )
    started[0] = time.monotonic()
    evaluate(0, trainer.model)
    started[0] = time.monotonic() - run.points[0].seconds
    trainer.train()
    run.train_seconds = time.monotonic() - started[0]
    run.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return run


# -----------------------------------------------------------------------------
# artgw


def run_artgw(args: argparse.Namespace, config: DemoConfig) -> Run:
    import psutil
    from rich.console import Console

    from artgw.demo import Demo

    run = Run("artgw (gateway + vLLM + trainer)")
    me = psutil.Process()
    peak = [0.0]
    done = threading.Event()

    def sample() -> None:  # the summed RSS of the demo and everything it started
        while not done.wait(0.5):
            total = 0
            for proc in [me, *me.children(recursive=True)]:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    pass
            peak[0] = max(peak[0], total / 2**20)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    demo = Demo(config, Console(stderr=True))
    try:
        result = demo.run()
    finally:
        done.set()
        sampler.join()
    evals = result.evals
    start = evals[0].elapsed if evals else 0.0
    for e in evals:
        run.points.append(Point(e.step, e.elapsed - start, e.reward, e.reward_ci))
    run.steps = len(result.steps)
    run.train_seconds = (evals[-1].elapsed - start) if evals else 0.0
    run.peak_rss_mb = peak[0]
    return run


def from_demo_results(path: Path) -> Run:
    """An earlier `artgw demo --model smollm2`'s held-out curve (its memory was not sampled: 0)."""
    result = json.loads(path.read_text())
    evals = result["evals"]
    start = evals[0]["elapsed"]
    run = Run(f"artgw ({path.parent.name})", steps=len(result["steps"]))
    run.points = [Point(e["step"], e["elapsed"] - start, e["reward"], tuple(e["reward_ci"])) for e in evals]
    run.train_seconds = evals[-1]["elapsed"] - start
    return run


# -----------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("/var/tmp/smollm2"), help="from artgw real-model")
    parser.add_argument("--which", choices=("both", "artgw", "trl"), default="both")
    parser.add_argument("--minutes", type=float, default=6.0, help="each one's training budget")
    parser.add_argument("--steps", type=int, default=16, help="at most")
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--eval-scenarios", type=int, default=32, help="held-out questions")
    parser.add_argument("--task", choices=list(real_task.TASKS), default=real_task.DEFAULT_TASK)
    parser.add_argument(
        "--artgw-results", type=Path, default=None, help="with --which trl: an earlier demo's results.json, beside"
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out/trl_compare"))
    args = parser.parse_args()
    from artgw.real_model import build_real_model

    build_real_model(args.model_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    config = DemoConfig.preset(
        model="smollm2",
        steps=args.steps,
        eval_every=args.eval_every,
        eval_scenarios=args.eval_scenarios,
        task=args.task,
        train_minutes=args.minutes,
        data_dir=args.model_dir.parent / "artgw-trl-compare",
        out=args.out / "artgw-demo",
    )
    (config.data_dir / "smollm2").parent.mkdir(parents=True, exist_ok=True)
    if not (config.data_dir / "smollm2").exists():
        os.symlink(args.model_dir.resolve(), config.data_dir / "smollm2")
    runs = []
    if args.which in ("both", "artgw"):
        runs.append(run_artgw(args, config))
    elif args.artgw_results:
        runs.append(from_demo_results(args.artgw_results))
    if args.which in ("both", "trl"):
        runs.append(run_trl(args, config))
    (args.out / f"{args.which}.json").write_text(
        json.dumps([{**r.__dict__, "points": [p.__dict__ for p in r.points]} for r in runs], indent=2) + "\n"
    )
    for r in runs:
        first, last = r.points[0], r.points[-1]
        print(
            f"| {r.name} | {r.steps} | {r.train_seconds / 60:.1f} | {first.reward:.3f} [{first.interval[0]:.2f}, "
            f"{first.interval[1]:.2f}] | {last.reward:.3f} [{last.interval[0]:.2f}, {last.interval[1]:.2f}] | "
            f"{(last.reward - first.reward) / max(r.train_seconds / 60, 1e-9):+.3f} | {r.peak_rss_mb:,.0f} |"
        )
    plot(runs, args.out / "trl_compare.png")


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for r, colour in zip(runs, ("tab:blue", "tab:red"), strict=False):
        xs = [p.seconds / 60 for p in r.points]
        ys = [p.reward for p in r.points]
        low = [y - p.interval[0] for y, p in zip(ys, r.points, strict=True)]
        high = [p.interval[1] - y for y, p in zip(ys, r.points, strict=True)]
        label = f"{r.name}, peak {r.peak_rss_mb:,.0f} MB" if r.peak_rss_mb else f"{r.name} (memory not sampled)"
        ax.errorbar(xs, ys, yerr=[low, high], fmt="o-", color=colour, capsize=3, label=label)
    ax.set_xlabel("minutes of training (after the first held-out evaluation)")
    ax.set_ylabel("held-out reward (sampled, 95 % interval)")
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("SmolLM2-135M-Instruct, GRPO on CPU: ART Gateway against TRL")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
