"""Trainer step throughput: our GRPO step (packed rows) vs TRL's own GRPO loss (padded batch), side by side.

One synthetic GRPO batch (default 8 groups x 4 trajectories, prompt 64 + completion 64 random token ids,
sampled logprobs = the initial policy's own logprobs + noise, random rewards, group-relative advantages) goes
through one optimizer step in each of:

- ours: `trainer.train.train_step` on a `StepData`, exactly as `artgw train` runs it: `pack_sequences` into
  rows of `--row-widths` tokens (block-diagonal causal mask, restarting position ids), forward in micro-batches
  of 8 rows, `token_logprobs` (TRL's `selective_log_softmax`) + `trainer.loss.grpo_loss`, backward, grad clip,
  AdamW step.
- trl: a real `trl.GRPOTrainer` (TRL 1.16, built once around the same PEFT LoRA model, `loss_type="grpo"`,
  `epsilon=0.2`, `epsilon_high=0.28`, `delta=2.0`, `beta=0`; the same knobs as ours) and its own
  `GRPOTrainer._compute_loss(model, inputs)` on the batch padded the way `_generate_and_score_completions` pads
  it (prompts left-padded, completions right-padded, `trl.trainer.utils.pad`); the sampled logprobs go in as
  `old_per_token_logps`. Then the same backward, grad clip and AdamW step.

Each (batch, implementation, layout) runs in a forked child of its own: the model is loaded, the batch built,
then the parent steps the children round-robin, one step of each case per round, `--warmup` + `--reps`
rounds, so load from other processes weighs on every case alike. After the warmup rounds each child frees what
it can (gc, `malloc_trim`), notes its RSS and resets its peak-RSS counter (`/proc/self/clear_refs` <- 5).
Reported: median step wall time (layout building included), trainable tokens/s = completion tokens / median
step time, peak memory = the child's VmHWM over the timed steps minus its RSS before them (CPU: process RSS,
so what one step holds at its peak: activations, logits, gradients, the mask; not code or the model), and the
loss at the initial weights (both implementations compute the same objective, so these must agree: a check that
the TRL side is assembled correctly).

    .venv/bin/python bench/trainer_throughput.py                     # both batches, both row widths
    .venv/bin/python bench/trainer_throughput.py --lengths fixed --reps 5 --row-widths 4096
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import multiprocessing
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")  # TRL warns about the vLLM version at import; torch about float() of a loss


@dataclass(frozen=True)
class Case:
    lengths: str  # fixed | variable
    impl: str  # ours | trl
    row_width: int  # ours: pack_sequences' max_tokens_per_row; trl: 0 (padded batch)


# -----------------------------------------------------------------------------
# the synthetic batch (identical in every child: same seed, same weights)


def make_batch(args: argparse.Namespace, lengths: str, model) -> dict[str, Any]:
    """Token ids, sampled logprobs and advantages of groups x group_size trajectories."""
    import torch

    from trainer.loss import compute_advantages

    rng = random.Random(args.seed)
    vocab = model.config.vocab_size
    prompts, completions = [], []
    for _ in range(args.groups):
        p_len = args.prompt_len if lengths == "fixed" else rng.randint(args.prompt_len // 4, args.prompt_len)
        prompt = [rng.randrange(3, vocab) for _ in range(p_len)]  # one prompt per group: GRPO's attempts
        for _ in range(args.group_size):
            c_len = (
                args.completion_len
                if lengths == "fixed"
                else rng.randint(args.completion_len // 8, args.completion_len)
            )
            prompts.append(prompt)
            completions.append([rng.randrange(3, vocab) for _ in range(c_len)])

    # Sampled logprobs: what the initial policy gives each completion token, plus noise (an engine that
    # sampled with slightly different numerics / an older adapter): ratios near 1, some clipped, some capped.
    noise = torch.Generator().manual_seed(args.seed)
    sampled = []
    model.eval()
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions, strict=True):
            ids = torch.tensor([prompt + completion])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            lp = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
            sampled.append((lp + 0.1 * torch.randn(lp.shape, generator=noise)).tolist())
    rewards = torch.tensor([rng.random() for _ in prompts], dtype=torch.float32)
    group_index = torch.arange(len(prompts)) // args.group_size
    return {
        "prompts": prompts,
        "completions": completions,
        "sampled": sampled,
        "rewards": rewards,
        "advantages": compute_advantages(rewards, group_index, scale="group"),
    }


# -----------------------------------------------------------------------------
# one step each way


def ours_step_fn(args: argparse.Namespace, case: Case, model, batch: dict[str, Any], pad_id: int):
    import torch

    from trainer.batch import TrainSequence
    from trainer.config import TrainConfig
    from trainer.train import StepData, make_optimizer, train_step

    config = TrainConfig(
        models=("bench",), base_model=str(args.model_dir), db="sqlite://", pack_tokens_per_row=case.row_width
    )
    optimizer = make_optimizer(model, config)
    sequences = [
        TrainSequence(
            token_ids=p + c,
            sampled_mask=[0] * len(p) + [1] * len(c),
            logprobs=[None] * len(p) + s,
            trajectory=i,
        )
        for i, (p, c, s) in enumerate(zip(batch["prompts"], batch["completions"], batch["sampled"], strict=True))
    ]
    data = StepData(
        group_ids=[f"g{i}" for i in range(args.groups)],
        sequences=sequences,
        advantages=batch["advantages"],
        rewards=batch["rewards"].tolist(),
        zero_signal_groups=0,
        zero_advantage_trajectories=0,
        staleness=0,
    )
    device = torch.device("cpu")

    def step() -> tuple[float, dict[str, Any]]:
        metrics = train_step(model, optimizer, data, config, device, pad_id)
        return metrics["loss"], {"rows": metrics["rows"], "padding": metrics["padding_tokens"]}

    step.sequences = sequences  # type: ignore[attr-defined]
    return step


def trl_step_fn(args: argparse.Namespace, model, tokenizer, batch: dict[str, Any], pad_id: int):
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import pad

    from trainer.config import TrainConfig
    from trainer.train import make_optimizer

    n = len(batch["prompts"])
    grpo_args = GRPOConfig(
        output_dir=str(args.work_dir / "trl-output"),  # never written: no training loop, no saving
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        bf16=False,
        loss_type="grpo",  # per-sequence token mean, then mean over sequences: our normalization="grpo"
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        delta=2.0,  # TRL's cap on the unclipped ratio: our tis_cap
        num_generations=args.group_size,
        per_device_train_batch_size=n,
        max_completion_length=args.completion_len,
        temperature=1.0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=grpo_args,
        train_dataset=Dataset.from_dict({"prompt": ["x"] * n}),
        processing_class=tokenizer,
    )
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); one micro-batch per step here
    optimizer = make_optimizer(trainer.model, TrainConfig(models=("bench",), base_model=str(args.model_dir), db="x"))
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    def step() -> tuple[float, dict[str, Any]]:
        # Exactly _generate_and_score_completions' padding of the generated batch.
        prompt_ids = [torch.tensor(ids) for ids in batch["prompts"]]
        prompt_mask = [torch.ones_like(ids, dtype=torch.long) for ids in prompt_ids]
        completion_ids = [torch.tensor(ids) for ids in batch["completions"]]
        completion_mask = [torch.ones_like(ids, dtype=torch.long) for ids in completion_ids]
        inputs = {
            "prompt_ids": pad(prompt_ids, padding_value=pad_id, padding_side="left"),
            "prompt_mask": pad(prompt_mask, padding_value=0, padding_side="left"),
            "completion_ids": pad(completion_ids, padding_value=pad_id, padding_side="right"),
            "completion_mask": pad(completion_mask, padding_value=0, padding_side="right"),
            "old_per_token_logps": pad(
                [torch.tensor(s) for s in batch["sampled"]], padding_value=0.0, padding_side="right"
            ),
            "advantages": batch["advantages"],
        }
        trainer.model.train()
        optimizer.zero_grad(set_to_none=True)
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        B = inputs["prompt_ids"].shape[0]
        T = inputs["prompt_ids"].shape[1] + inputs["completion_ids"].shape[1]
        real = sum(len(p) + len(c) for p, c in zip(batch["prompts"], batch["completions"], strict=True))
        return float(loss.detach()), {"rows": B, "padding": B * T - real, "layout": f"padded {B}x{T}"}

    return step


# -----------------------------------------------------------------------------
# a child per case


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def serve_case(args: argparse.Namespace, case: Case, conn) -> None:
    """Child: set up the case, then run one step per "step" the parent sends; "done" answers the peak memory."""
    try:
        step, mark, finish = setup_case(args, case)
        conn.send({"ready": True})
        while (command := conn.recv()) != "done":
            if command == "mark":
                conn.send({"baseline_kib": mark()})
                continue
            started = time.perf_counter()
            loss, info = step()
            conn.send({"seconds": time.perf_counter() - started, "loss": loss, **info})
        conn.send(finish())
    except BaseException as exc:  # report, don't hang the parent
        import traceback

        conn.send({"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})
    finally:
        conn.close()


def setup_case(args: argparse.Namespace, case: Case):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.batch import pack_sequences
    from trainer.config import TrainConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    defaults = TrainConfig(models=("bench",), base_model=str(args.model_dir), db="x")
    base = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    batch = make_batch(args, case.lengths, base)
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    lora = LoraConfig(
        r=defaults.lora_rank,
        lora_alpha=defaults.lora_alpha,
        lora_dropout=defaults.lora_dropout,
        target_modules=list(defaults.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, lora)  # the same LoRA as `artgw train` (seeded: same init in every child)
    if case.impl == "ours":
        step = ours_step_fn(args, case, model, batch, pad_id)
    else:
        step = trl_step_fn(args, model, tokenizer, batch, pad_id)
    baseline = 0

    def mark() -> int:
        """After the warmup steps (code pages of the kernels faulted in, lazy state built), with freed heap
        memory handed back to the OS: the RSS the timed steps' peak is measured from."""
        nonlocal baseline
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        baseline = _rss_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (peak RSS) to the current RSS
        return baseline

    def finish() -> dict[str, Any]:
        info = {"peak_mb": (_rss_kib("VmHWM") - baseline) / 1024}
        if case.impl == "ours":  # train_step does not report the row length
            packed = pack_sequences(step.sequences, max_tokens_per_row=case.row_width, pad_id=pad_id)
            info["layout"] = f"packed {packed.input_ids.shape[0]}x{packed.input_ids.shape[1]}"
        info["trainable_tokens"] = sum(len(c) for c in batch["completions"])
        info["real_tokens"] = sum(len(p) + len(c) for p, c in zip(batch["prompts"], batch["completions"], strict=True))
        return info

    return step, mark, finish


def run_cases(args: argparse.Namespace, cases: list[Case], ctx) -> dict[Case, dict[str, Any]]:
    """Every case in a child of its own, all set up first, then stepped round-robin: one step of each case per
    round, so whatever else the machine does at a given moment weighs on every case alike."""
    children, conns = [], []
    for case in cases:
        parent_end, child_end = ctx.Pipe()
        child = ctx.Process(target=serve_case, args=(args, case, child_end), daemon=True)
        child.start()
        child_end.close()
        children.append(child)
        conns.append(parent_end)
    try:
        for case, conn in zip(cases, conns, strict=True):
            answer = conn.recv()
            if "error" in answer:
                raise RuntimeError(f"{case}: {answer['error']}")
        steps: dict[Case, list[dict[str, Any]]] = {case: [] for case in cases}
        for round_ in range(args.warmup + args.reps):
            if round_ == args.warmup:
                for conn in conns:
                    conn.send("mark")
                    conn.recv()
            for case, conn in zip(cases, conns, strict=True):
                conn.send("step")
                answer = conn.recv()
                if "error" in answer:
                    raise RuntimeError(f"{case}: {answer['error']}")
                steps[case].append(answer)
            print(f"  round {round_ + 1}/{args.warmup + args.reps}", file=sys.stderr)
        results = {}
        for case, conn in zip(cases, conns, strict=True):
            conn.send("done")
            final = conn.recv()
            if "error" in final:
                raise RuntimeError(f"{case}: {final['error']}")
            timed = [s["seconds"] for s in steps[case][args.warmup :]]
            median = statistics.median(timed)
            results[case] = {
                **steps[case][-1],
                **final,
                "median_s": median,
                "min_s": min(timed),
                "max_s": max(timed),
                "tokens_per_s": final["trainable_tokens"] / median,
                "loss0": steps[case][0]["loss"],  # at the initial weights
            }
        return results
    finally:
        for child in children:
            child.join(30)
            if child.is_alive():
                child.kill()


# -----------------------------------------------------------------------------
# main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="GRPO trainer step throughput: ours (trainer.train.train_step, packed rows) vs TRL's own "
        "GRPOTrainer._compute_loss (padded batch) on the same synthetic batch and the same PEFT LoRA model.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model-dir", type=Path, help="base model directory (default: build the tiny model)")
    parser.add_argument("--groups", type=int, default=8, help="groups in the batch")
    parser.add_argument("--group-size", type=int, default=4, help="trajectories per group")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (variable: U[len/4, len])")
    parser.add_argument("--completion-len", type=int, default=64, help="completion tokens (variable: U[len/8, len])")
    parser.add_argument(
        "--lengths", default="fixed,variable", help="batches to run: fixed (every length as given), variable"
    )
    parser.add_argument(
        "--row-widths", default="4096,512", help="our packing widths (pack_tokens_per_row; 512 = trainer default)"
    )
    parser.add_argument("--reps", type=int, default=9, help="timed steps per case (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (0: torch's default, one per core); 1 by default: on a shared 2-core machine two "
        "OpenMP threads contend with every other process and the medians swing by 3x",
    )
    parser.add_argument("--seed", type=int, default=0, help="batch and LoRA-init seed")
    args = parser.parse_args(argv)
    if not set(args.lengths.split(",")) <= {"fixed", "variable"}:
        parser.error("--lengths takes fixed, variable or both (comma-separated)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = multiprocessing.get_context("fork")  # the parent only imports: no torch thread pool exists to fork
    tmp = tempfile.TemporaryDirectory(prefix="trainer-bench-")
    args.work_dir = Path(tmp.name)
    if args.model_dir is None:
        args.model_dir = args.work_dir / "tiny"
        child = ctx.Process(target=_build_tiny, args=(args.model_dir,))
        child.start()
        child.join()
        if child.exitcode != 0:
            print("building the tiny model failed", file=sys.stderr)
            return 1
    # Imported once here, before forking, so each child starts in a second rather than in ~15.
    import peft
    import torch
    import transformers
    import trl

    import trainer.train  # noqa: F401

    cases = [
        Case(lengths, impl, width)
        for lengths in args.lengths.split(",")
        for impl, widths in (("ours", [int(w) for w in args.row_widths.split(",")]), ("trl", [0]))
        for width in widths
    ]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = os.getloadavg()
    try:
        results = run_cases(args, cases, ctx)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(
        f"\n{started}; {os.cpu_count()} cores ({cpu}); load average before {load[0]:.2f}; Python "
        f"{platform.python_version()}, torch {torch.__version__} ({args.threads or torch.get_num_threads()} threads), "
        f"transformers {transformers.__version__}, peft {peft.__version__}, trl {trl.__version__}; model "
        f"{args.model_dir}; batch {args.groups} groups x {args.group_size}; {args.warmup} warmup + {args.reps} timed "
        "steps per case (round-robin), median.\n"
    )
    print(
        "| batch | implementation | layout (rows x T) | padding | step s (median, min-max) | trainable tok/s "
        "| vs TRL | peak RSS delta MB | loss at init |"
    )
    print("|---|---|---|--:|--:|--:|--:|--:|--:|")
    for lengths in args.lengths.split(","):
        trl_result = results[Case(lengths, "trl", 0)]
        for case in [c for c in cases if c.lengths == lengths]:
            r = results[case]
            name = (
                "ours: train_step (pack_sequences + grpo_loss)"
                if case.impl == "ours"
                else "TRL 1.16: GRPOTrainer._compute_loss"
            )
            if case.impl == "ours":
                name += f", rows of {case.row_width}"
            batch = (
                f"{lengths} {args.prompt_len}+{args.completion_len}"
                if lengths == "fixed"
                else f"variable <= {args.prompt_len}+{args.completion_len}"
            )
            padding = r["padding"] / (r["real_tokens"] + r["padding"])
            print(
                f"| {batch} ({r['trainable_tokens']} trainable / {r['real_tokens']} tokens) | {name} "
                f"| {r['layout']} | {padding:.0%} | {r['median_s']:.3f} ({r['min_s']:.3f}-{r['max_s']:.3f}) "
                f"| {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / trl_result['tokens_per_s']:.2f}x "
                f"| {r['peak_mb']:.1f} | {r['loss0']:.6f} |"
            )
    print(
        "\nstep = layout building + forward + loss + backward + grad clip + AdamW step; trainable tok/s = completion "
        "tokens / median step time; peak RSS delta = VmHWM over the timed steps minus VmRSS before them (after "
        "the warmup, gc and malloc_trim; VmHWM reset through /proc/self/clear_refs); each case in a forked child, "
        "cases stepped round-robin; loss at init = each implementation's loss at the initial weights (they compute "
        "the same objective, so equal up to float rounding)."
    )
    tmp.cleanup()
    return 0


def _build_tiny(out: Path) -> None:
    from artgw.tiny_model import build_tiny_model

    build_tiny_model(out)


if __name__ == "__main__":
    sys.exit(main())
