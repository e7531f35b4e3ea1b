"""Trainer step throughput and memory: our GRPO step (packed rows) vs TRL's own GRPO loss (padded batch).

Synthetic GRPO batches (groups x trajectories of random token ids, one prompt per group; sampled logprobs = the
initial policy's own logprobs + N(0, 0.1) noise; random rewards, group-relative advantages) go through one
optimizer step in each of:

- ours: `trainer.step.train_step` on a `StepData`, exactly as `artgw train` runs it: `pack_sequences` into
  rows of `--row-widths` tokens (block-diagonal causal mask, restarting position ids), forward in micro-batches,
  `policy_token_logprobs` (the model's body, then the output layer over the trained positions only, in chunks of
  the trainer's `logprob_chunk_tokens`) + `grpo_loss`, backward, grad clip, AdamW step.
- trl: a real `trl.GRPOTrainer` (TRL 1.16, built once around the same PEFT LoRA model, `loss_type="grpo"`,
  `epsilon=0.2`, `epsilon_high=0.28`, `delta=2.0`, `beta=0`; the same knobs as ours) and its own
  `GRPOTrainer._compute_loss(model, inputs)` on the batch padded the way `_generate_and_score_completions` pads
  it (prompts left-padded, completions right-padded, `trl.trainer.utils.pad`); the sampled logprobs go in as
  `old_per_token_logps`. Then the same backward, grad clip and AdamW step.

Models (`--model`): `tiny`, the project's tiny model (1,030-token vocabulary: the body dominates), and
`real-vocab`, shaped like a real model at the output: Qwen2's 151,936-token vocabulary on Qwen2.5-0.5B's layer
shapes (hidden 896, tied embeddings), 2 of its 24 layers, so the output layer dominates as it does in real
models. Batches: `--lengths` fixed (every completion as long) and variable (U[len/8, len]); with
`--completion-tokens`, each batch's completions add up to that many tokens (exactly when fixed, on average
when variable).

A child process prepares the model and the batches once (the sampled logprobs need a forward pass of each
sequence); then each (batch, implementation, row width) runs in a forked child of its own, and the parent steps
the children round-robin, one step of each case per round, `--warmup` + `--reps` rounds, so load from other
processes weighs on every case alike. After the warmup rounds each child frees what it can (gc, `malloc_trim`),
notes its RSS and resets its peak-RSS counter (`/proc/self/clear_refs` <- 5). Reported: median step wall time
(layout building included), trainable tokens/s = completion tokens / median step time, peak memory = the
child's VmHWM over the timed steps minus its RSS before them (CPU: process RSS, so what one step holds at its
peak: activations, logits, gradients, the mask; not code or the model), and the loss at the initial weights
(both implementations compute the same objective, so these must agree: a check that the TRL side is assembled
correctly).

    .venv/bin/python bench/trainer_throughput.py --quick                 # real-vocab, one small batch: ~1 min
    .venv/bin/python bench/trainer_throughput.py --model real-vocab      # 1k and 4k tokens, fixed and variable
    .venv/bin/python bench/trainer_throughput.py                         # the tiny model, as measured before
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

# Qwen2.5-0.5B's shapes (its vocabulary is Qwen2's), with 2 of its 24 layers.
REAL_VOCAB_SHAPE = {
    "vocab_size": 151_936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 2,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
# Per model, what an option left out means (--quick first fills in its own values).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "groups": 8,
        "group_size": 4,
        "prompt_len": 64,
        "completion_len": 64,
        "lengths": "fixed,variable",
        "row_widths": "4096,512",
        "reps": 9,
        "warmup": 2,
    },
    "real-vocab": {
        "groups": 2,
        "group_size": 4,
        "prompt_len": 128,
        "completion_tokens": "1024,4096",
        "lengths": "fixed,variable",
        "row_widths": "512",
        "reps": 3,
        "warmup": 1,
    },
}
QUICK = {
    "model": "real-vocab",
    "groups": 1,
    "prompt_len": 32,
    "completion_tokens": "256",
    "lengths": "fixed",
    "reps": 1,
    "warmup": 1,
}
PROJECT_PACKAGES = ("artgw", "client", "gateway", "store", "trainer", "ruler", "migrations")
# Tensor methods that read values into Python (count_reads); __getitem__/__setitem__ count boolean-mask indexing.
READ_METHODS = (
    "item",
    "tolist",
    "__float__",
    "__int__",
    "__bool__",
    "__index__",
    "nonzero",
    "__getitem__",
    "__setitem__",
)
TARGET_TOKENS = 4096  # the batch the targets below are about
TARGET_SPEEDUP = 2.0  # ours >= 2x TRL's trainable tokens/s
# --baseline: this tree's tok/s against the baseline's. One case's median moves by ~5 % between two runs of the same
# code on this machine (0.99x and 0.95x for one case, 2026-11-27), so the rule is on the mean over the cases, with a
# floor for each.
BASELINE_MIN_SPEED = 0.97
BASELINE_MIN_CASE_SPEED = 0.90
# Peak memory: torch's own allocations (the profiler's on CPU, the allocator's on CUDA), the same for the same code.
BASELINE_MAX_MEMORY = 1.01  # float rounding: the same code gives the same figure
BASELINE_MAX_CASE_MEMORY = 1.02
TARGET_MEMORY = 0.3  # ours <= 0.3x TRL's peak memory


@dataclass(frozen=True)
class Batch:
    lengths: str  # fixed | variable
    completion_len: int  # fixed: every completion's length; variable: the longest one
    target: int | None  # completion tokens asked for (--completion-tokens); None: set by --completion-len


@dataclass(frozen=True)
class Case:
    batch: Batch
    impl: str  # ours | baseline (ours at --baseline REV) | trl
    row_width: int  # ours: the trainer's pack_tokens_per_row; trl: 0 (padded batch)


def batches(args: argparse.Namespace) -> list[Batch]:
    n = args.groups * args.group_size
    out = []
    for lengths in args.lengths.split(","):
        if args.completion_tokens is None:
            out.append(Batch(lengths, args.completion_len, None))
            continue
        for target in (int(t) for t in args.completion_tokens.split(",")):
            # U[len/8, len] averages 9/16 len: the longest completion that makes the batch `target` on average.
            longest = target // n if lengths == "fixed" else round(target / n * 16 / 9)
            out.append(Batch(lengths, longest, target))
    return out


# -----------------------------------------------------------------------------
# the model and the synthetic batches, prepared once in a child


def prepare(args: argparse.Namespace, todo: list[Batch]) -> None:
    """Child: build the model (unless --model-dir) and write every batch to work_dir (see batch_path)."""
    import torch
    from transformers import AutoModelForCausalLM

    if args.build_model:
        build_model(args.model, args.model_dir, args.layers)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    for batch in todo:
        torch.save(make_batch(args, batch, model), batch_path(args, batch))


def batch_path(args: argparse.Namespace, batch: Batch) -> Path:
    return args.work_dir / f"batch-{batch.lengths}-{batch.completion_len}.pt"


def build_model(kind: str, out: Path, layers: int | None = None) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from artgw.tiny_model import TinyModelSpec, build_tiny_model, build_tokenizer

    if kind == "tiny":
        build_tiny_model(out)
        return
    spec = TinyModelSpec()
    tokenizer = build_tokenizer(spec)  # its ids are a subset of the vocabulary: enough for TRL's padding
    eos_id, pad_id = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(
        **{**REAL_VOCAB_SHAPE, **({"num_hidden_layers": layers} if layers else {})},
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(spec.seed)
    Qwen2ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=pad_id).save_pretrained(out)


def make_batch(args: argparse.Namespace, batch: Batch, model) -> dict[str, Any]:
    """Token ids, sampled logprobs and advantages of groups x group_size trajectories."""
    import torch

    from trainer.logprobs import policy_token_logprobs
    from trainer.loss import compute_advantages

    rng = random.Random(args.seed)
    vocab = model.config.vocab_size
    prompts, completions = [], []
    for _ in range(args.groups):
        p_len = args.prompt_len if batch.lengths == "fixed" else rng.randint(args.prompt_len // 4, args.prompt_len)
        prompt = [rng.randrange(3, vocab) for _ in range(p_len)]  # one prompt per group: GRPO's attempts
        for _ in range(args.group_size):
            longest = batch.completion_len
            c_len = longest if batch.lengths == "fixed" else rng.randint(max(longest // 8, 1), longest)
            prompts.append(prompt)
            completions.append([rng.randrange(3, vocab) for _ in range(c_len)])

    # Sampled logprobs: what the initial policy gives each completion token, plus noise (an engine that
    # sampled with slightly different numerics / an older adapter): ratios near 1, some clipped, some capped.
    # The output layer runs over the completion only: on the real vocabulary that is most of the cost.
    noise = torch.Generator().manual_seed(args.seed)
    sampled = []
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions, strict=True):
            ids = torch.tensor([prompt + completion])
            scored = torch.zeros(ids.shape, dtype=torch.bool)
            scored[0, len(prompt) - 1 : -1] = True  # position t predicts token t + 1
            lp = policy_token_logprobs(
                model,
                ids,
                torch.arange(ids.shape[1])[None],
                None,
                ids.roll(-1, dims=1),
                scored,
                chunk_size=1024,
            )[scored]
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
    """A step of `artgw train`'s own: this tree's, or (case.impl "baseline") the --baseline tree's, whose
    train_step took the PEFT model itself."""
    import torch

    if case.impl == "baseline":
        from trainer.train import StepData, make_optimizer, train_step  # the baseline tree's (use_baseline_tree)
    else:
        from trainer.batch import StepData
        from trainer.model import Policy, make_optimizer
        from trainer.step import train_step
    from trainer.batch import TrainSequence
    from trainer.config import TrainConfig

    config = TrainConfig(
        models=("bench",),
        base_model=str(args.model_dir),
        db="sqlite://",
        pack_tokens_per_row=case.row_width,
        # The trainer's own defaults unless the command line sets them.
        **({"logprob_chunk_tokens": args.chunk_tokens} if args.chunk_tokens else {}),
        **({"micro_batch_rows": args.micro_batch_rows} if args.micro_batch_rows else {}),
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
    device = torch.device(args.device)
    trained = model if case.impl == "baseline" else Policy.of(model, config, device)

    def step() -> tuple[float, dict[str, Any]]:
        metrics = train_step(trained, optimizer, data, config, device, pad_id)
        return metrics.loss, {"rows": metrics.rows, "padding": metrics.padding_tokens}

    step.sequences = sequences  # type: ignore[attr-defined]
    return step


def use_baseline_tree(tree: Path) -> None:
    """From here on, this process imports the project's packages from `tree` (the --baseline export): those the
    parent imported before forking are forgotten first."""
    for name in list(sys.modules):
        if name.split(".")[0] in PROJECT_PACKAGES:
            del sys.modules[name]
    sys.path.insert(0, str(tree))


def allocated_peak_mb(step) -> float:
    """Runs `step` once under torch's profiler and returns the most its tensors held at once beyond what was held
    when it started (torch's own allocations, counted event by event: the same code gives the same figure, where
    the process's peak RSS moves by ~10 % between runs with malloc's arenas)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        step()
    memory = [e for e in profiled.profiler.kineto_results.events() if e.name() == "[memory]"]
    held = peak = 0
    for event in sorted(memory, key=lambda e: e.start_ns()):
        held += event.nbytes()
        peak = max(peak, held)
    return peak / 2**20


def count_reads(step, device: str) -> dict[str, int]:
    """Runs `step` once, counting the reads of tensor values into Python (item, float(), int(), bool(), tolist,
    nonzero and boolean-mask indexing: on a GPU each waits for the device) and, on CUDA, the synchronizing
    operations torch's sync debug mode reports (the waits themselves, whatever asked for them)."""
    import torch

    counts = {"reads": 0, "syncs": 0}
    originals = {name: getattr(torch.Tensor, name) for name in READ_METHODS}

    def counting(original):
        def read(*args, **kwargs):
            counts["reads"] += 1
            return original(*args, **kwargs)

        return read

    def masked(original):
        def index(tensor, key, *rest):
            keys = key if isinstance(key, tuple) else (key,)
            if any(isinstance(k, torch.Tensor) and k.dtype == torch.bool for k in keys):
                counts["reads"] += 1  # a boolean mask is turned into indices: its count is read
            return original(tensor, key, *rest)

        return index

    for name, original in originals.items():
        setattr(torch.Tensor, name, masked(original) if name in ("__getitem__", "__setitem__") else counting(original))
    try:
        if device != "cuda":
            step()
            return counts
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
        torch.cuda.set_sync_debug_mode(0)
        counts["syncs"] = sum("synchronizing" in str(w.message) for w in caught)
        return counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def trl_step_fn(args: argparse.Namespace, model, tokenizer, batch: dict[str, Any], pad_id: int):
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer
    from trl.trainer.utils import pad

    from trainer.config import TrainConfig
    from trainer.model import make_optimizer

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
        max_completion_length=max(len(c) for c in batch["completions"]),
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
    """Child: set up the case, then run one step per "step" the parent sends; "done" answers the peak memory and
    the reads of one more step (count_reads)."""
    try:
        import torch

        step, mark, finish = setup_case(args, case)
        conn.send({"ready": True})
        while (command := conn.recv()) != "done":
            if command == "mark":
                conn.send({"baseline_kib": mark()})
                continue
            started = time.perf_counter()
            loss, info = step()  # ours reads its figures at the step's end: the device's work is done
            if args.device == "cuda":
                torch.cuda.synchronize()
            conn.send({"seconds": time.perf_counter() - started, "loss": loss, **info})
        conn.send(finish())
    except BaseException as exc:  # report, don't hang the parent
        import traceback

        conn.send({"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})
    finally:
        conn.close()


def setup_case(args: argparse.Namespace, case: Case):
    if case.impl == "baseline":
        use_baseline_tree(args.baseline_tree)
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.batch import pack_sequences
    from trainer.config import TrainConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    defaults = TrainConfig(models=("bench",), base_model=str(args.model_dir), db="x")
    cuda = args.device == "cuda"
    # As `artgw train` loads it: bf16 on a GPU (trainer/model.py compute_dtype), float32 on CPU.
    dtype = torch.bfloat16 if cuda else torch.float32
    base = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype, attn_implementation="sdpa")
    batch = torch.load(batch_path(args, case.batch))
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
    model = get_peft_model(base, lora).to(args.device)  # as `artgw train`'s LoRA (seeded: the same in every child)
    if case.impl != "trl":
        step = ours_step_fn(args, case, model, batch, pad_id)
    else:
        step = trl_step_fn(args, model, tokenizer, batch, pad_id)
    baseline = 0

    def mark() -> int:
        """After the warmup steps (code pages of the kernels faulted in, lazy state built), with freed heap
        memory handed back to the OS: the RSS the timed steps' peak is measured from."""
        nonlocal baseline
        gc.collect()
        if cuda:  # the device's memory: what the step holds beyond the model
            torch.cuda.synchronize()
            baseline = torch.cuda.memory_allocated() // 1024
            torch.cuda.reset_peak_memory_stats()
            return baseline
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        baseline = _rss_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (peak RSS) to the current RSS
        return baseline

    def finish() -> dict[str, Any]:
        peak = torch.cuda.max_memory_allocated() // 1024 if cuda else _rss_kib("VmHWM")
        info = {"peak_mb": (peak - baseline) / 1024, **count_reads(step, args.device)}
        if not cuda:  # on CUDA peak_mb is torch's own peak allocation already
            info["allocated_peak_mb"] = allocated_peak_mb(step)
        if case.impl != "trl":  # train_step does not report the row length; it widens rows as train_step does
            width = max(case.row_width, max(len(s.token_ids) for s in step.sequences))
            packed = pack_sequences(step.sequences, max_tokens_per_row=width, pad_id=pad_id)
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
        description="GRPO trainer step throughput and memory: ours (trainer.step.train_step, packed rows) vs TRL's "
        "own GRPOTrainer._compute_loss (padded batch) on the same synthetic batch and the same PEFT LoRA model. "
        "Options left out take the --model's preset: "
        + "; ".join(f"{m}: " + ", ".join(f"{k}={v}" for k, v in p.items()) for m, p in PRESETS.items()),
    )
    parser.add_argument("--model", choices=list(PRESETS), help="which model to build (default: tiny)")
    parser.add_argument("--model-dir", type=Path, help="a local base model instead (presets of --model apply)")
    parser.add_argument(
        "--layers",
        type=int,
        help="real-vocab: layers of Qwen2.5-0.5B's 24 to build (default 2: the output layer dominates)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="~1 min for development: " + ", ".join(f"{k}={v}" for k, v in QUICK.items()) + " (unless given)",
    )
    parser.add_argument("--groups", type=int, help="groups in the batch")
    parser.add_argument("--group-size", type=int, help="trajectories per group")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens (variable: U[len/4, len])")
    parser.add_argument("--completion-len", type=int, help="completion tokens (variable: U[len/8, len])")
    parser.add_argument(
        "--completion-tokens",
        help="instead of --completion-len: a batch per value (comma-separated) whose completions add up to that "
        "many tokens (variable lengths: on average)",
    )
    parser.add_argument("--lengths", help="batches to run: fixed, variable or both (comma-separated)")
    parser.add_argument("--row-widths", help="our packing widths (pack_tokens_per_row; 512 = trainer default)")
    parser.add_argument("--chunk-tokens", type=int, help="our logprob_chunk_tokens (default: the trainer's)")
    parser.add_argument("--micro-batch-rows", type=int, help="our micro_batch_rows (default: the trainer's)")
    parser.add_argument("--reps", type=int, help="timed steps per case (median reported)")
    parser.add_argument("--warmup", type=int, help="untimed steps first")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (0: torch's default, one per core); 1 by default: on a shared 2-core machine two "
        "OpenMP threads contend with every other process and the medians swing by 3x",
    )
    parser.add_argument("--seed", type=int, default=0, help="batch and LoRA-init seed")
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also run `artgw train`'s step as it was at this git revision (exported with git archive; or a directory "
        "holding such an export), side by "
        "side: a table of this tree's tok/s, peak memory and reads/syncs per step against it, and 'not slower, not "
        "heavier: PASS/FAIL'",
    )
    parser.add_argument("--no-trl", action="store_true", help="leave TRL out (with --baseline: before and after only)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the steps run; cuda: bf16 as `artgw train` loads it, peak = torch's peak allocation, TRL left "
        "out, and the synchronizing operations counted by torch's sync debug mode",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda":
        args.no_trl = True
    # Options given win; then --quick's values, then the model's preset.
    if args.quick:
        _fill_in(args, QUICK)
    args.model = args.model or "tiny"
    _fill_in(args, PRESETS[args.model])
    if not set(args.lengths.split(",")) <= {"fixed", "variable"}:
        parser.error("--lengths takes fixed, variable or both (comma-separated)")
    return args


def _fill_in(args: argparse.Namespace, defaults: dict[str, Any]) -> None:
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = multiprocessing.get_context("fork")  # the parent only imports: no torch thread pool exists to fork
    tmp = tempfile.TemporaryDirectory(prefix="trainer-bench-")
    args.work_dir = Path(tmp.name)
    args.build_model = args.model_dir is None
    if args.build_model:
        args.model_dir = args.work_dir / args.model
    todo = batches(args)
    started_prepare = time.monotonic()
    child = ctx.Process(target=prepare, args=(args, todo))
    child.start()
    child.join()
    if child.exitcode != 0:
        print("preparing the model and the batches failed", file=sys.stderr)
        return 1
    print(f"  model and {len(todo)} batches ready in {time.monotonic() - started_prepare:.0f} s", file=sys.stderr)
    # Imported once here, before forking, so each child starts in a second rather than in ~15.
    import peft
    import torch
    import transformers

    import trainer.step  # noqa: F401

    if not args.no_trl:
        import trl  # noqa: F401

    widths = [int(w) for w in args.row_widths.split(",")]
    impls = [("ours", widths)]
    if args.baseline:  # a revision, or a directory that holds a tree already exported (a machine without git)
        tree = Path(args.baseline)
        args.baseline_tree = tree.resolve() if tree.is_dir() else export_tree(args.baseline, args.work_dir / "baseline")
        impls.append(("baseline", widths))
    if not args.no_trl:
        impls.append(("trl", [0]))
    cases = [Case(batch, impl, width) for batch in todo for impl, impl_widths in impls for width in impl_widths]
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
        f"transformers {transformers.__version__}, peft {peft.__version__}; device {device_name(args.device)}; model "
        f"{args.model if args.build_model else args.model_dir}; {args.groups} groups x {args.group_size}; "
        f"{args.warmup} warmup + {args.reps} timed steps per case (round-robin), median.\n"
    )
    if not args.no_trl:
        print(print_table(args, todo, cases, results))
    if args.baseline:
        print(baseline_table(args, todo, cases, results))
    tmp.cleanup()
    return 0


def export_tree(rev: str, out: Path) -> Path:
    """The project's files at git revision `rev`, in `out`."""
    import subprocess

    out.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"--baseline {rev}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out


def device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def baseline_table(args: argparse.Namespace, todo: list[Batch], cases: list[Case], results: dict) -> str:
    """This tree's step against the --baseline's, per batch and row width, and the verdict."""
    lines = [
        f"\nthis tree vs --baseline {args.baseline} ({args.device}):\n",
        "| batch | rows of | tok/s now | tok/s before | now/before | peak MB now | peak MB before | now/before "
        "| reads/step now | before | syncs/step now | before |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    speeds, memories = [], []
    for batch in todo:
        name = f"{batch.lengths} {args.prompt_len}+{batch.completion_len}"
        for case in [c for c in cases if c.batch == batch and c.impl == "ours"]:
            now, before = results[case], results[Case(batch, "baseline", case.row_width)]
            speed = now["tokens_per_s"] / before["tokens_per_s"]
            peak = "allocated_peak_mb" if "allocated_peak_mb" in now else "peak_mb"
            memory = now[peak] / before[peak] if before[peak] > 0 else float("nan")
            speeds.append(speed)
            memories.append(memory)
            syncs = (now["syncs"], before["syncs"]) if args.device == "cuda" else ("-", "-")
            lines.append(
                f"| {name} | {case.row_width} | {now['tokens_per_s']:,.0f} | {before['tokens_per_s']:,.0f} "
                f"| **{speed:.2f}x** | {now[peak]:,.1f} | {before[peak]:,.1f} | **{memory:.2f}x** "
                f"| {now['reads']} | {before['reads']} | {syncs[0]} | {syncs[1]} |"
            )
    mean_speed, mean_memory = statistics.geometric_mean(speeds), statistics.geometric_mean(memories)
    ok = (
        mean_speed >= BASELINE_MIN_SPEED
        and min(speeds) >= BASELINE_MIN_CASE_SPEED
        and mean_memory <= BASELINE_MAX_MEMORY
        and max(memories) <= BASELINE_MAX_CASE_MEMORY
    )
    lines.append(
        "\npeak MB: the most the step's tensors held at once beyond what they held when it started (CPU: torch's "
        "allocations counted by its profiler over one step; CUDA: torch.cuda.max_memory_allocated over the timed "
        "steps).\nreads/step: tensor values read into Python during one step (item, float(), int(), bool(), tolist, "
        "nonzero, boolean-mask indexing), host tensors included; syncs/step (CUDA only): the synchronizing "
        "operations torch.cuda.set_sync_debug_mode reports.\n"
        f"now/before, geometric mean over the cases: tok/s {mean_speed:.3f}x, peak memory {mean_memory:.3f}x\n"
        f"not slower, not heavier: {'PASS' if ok else 'FAIL'} (tok/s: the mean >= {BASELINE_MIN_SPEED:.0%}, every "
        f"case >= {BASELINE_MIN_CASE_SPEED:.0%} of the baseline's; peak memory: the mean <= {BASELINE_MAX_MEMORY:.0%}, "
        f"every case <= {BASELINE_MAX_CASE_MEMORY:.0%})"
    )
    return "\n".join(lines)


def print_table(args: argparse.Namespace, todo: list[Batch], cases: list[Case], results: dict) -> str:
    """One line per batch (and row width of ours): ours and TRL side by side, then the targets' verdicts."""
    lines = [
        "| batch | trainable / all tokens | ours: layout | TRL: layout (padding) | ours tok/s | TRL tok/s "
        "| ours/TRL | ours peak MB | TRL peak MB | ours/TRL | ours step s (min-max) | TRL step s (min-max) "
        "| loss at init ours / TRL |",
        "|---|--:|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    verdicts = []
    for batch in todo:
        trl = results[Case(batch, "trl", 0)]
        name = f"{batch.lengths} {args.prompt_len}+{batch.completion_len}"
        if batch.lengths == "variable":
            name = f"variable <= {args.prompt_len}+{batch.completion_len}"
        for case in [c for c in cases if c.batch == batch and c.impl == "ours"]:
            ours = results[case]
            speed = ours["tokens_per_s"] / trl["tokens_per_s"]
            memory = ours["peak_mb"] / trl["peak_mb"] if trl["peak_mb"] > 0 else float("nan")
            trl_padding = trl["padding"] / (trl["real_tokens"] + trl["padding"])
            lines.append(
                f"| {name} | {ours['trainable_tokens']:,} / {ours['real_tokens']:,} "
                f"| {ours['layout']} (rows of {case.row_width}) | {trl['layout']} ({trl_padding:.0%}) "
                f"| {ours['tokens_per_s']:,.0f} | {trl['tokens_per_s']:,.0f} | **{speed:.2f}x** "
                f"| {ours['peak_mb']:,.0f} | {trl['peak_mb']:,.0f} | **{memory:.2f}x** "
                f"| {ours['median_s']:.2f} ({ours['min_s']:.2f}-{ours['max_s']:.2f}) "
                f"| {trl['median_s']:.2f} ({trl['min_s']:.2f}-{trl['max_s']:.2f}) "
                f"| {ours['loss0']:.6f} / {trl['loss0']:.6f} |"
            )
            if batch.target == TARGET_TOKENS:
                verdicts.append(
                    f"{name}, rows of {case.row_width}: tokens/s {speed:.2f}x TRL "
                    f"({'PASS' if speed >= TARGET_SPEEDUP else 'FAIL'}, target >= {TARGET_SPEEDUP}x); peak memory "
                    f"{memory:.2f}x TRL ({'PASS' if memory <= TARGET_MEMORY else 'FAIL'}, target <= {TARGET_MEMORY}x)"
                )
    lines.append(
        "\nstep = layout building + forward + loss + backward + grad clip + AdamW step; tok/s = completion tokens / "
        "median step time; peak = VmHWM over the timed steps minus VmRSS before them (after the warmup, gc and "
        "malloc_trim; VmHWM reset through /proc/self/clear_refs); each case in a forked child, cases stepped "
        "round-robin; loss at init: both compute the same objective, so equal up to float rounding."
    )
    if verdicts:
        lines += [f"\ntargets at {TARGET_TOKENS:,} completion tokens:", *(f"- {v}" for v in verdicts)]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
