"""The trainer's step alone and under DistributedDataParallel in a process group of one (NCCL on CUDA, gloo on
CPU): the same step, so the group's plumbing (DDP, its summing comm hook, the all-reduces of the figures) is
exercised on the device without a second GPU. Prints one table: loss, grad norm, the largest LoRA difference and
the step's seconds, each way.

    .venv/bin/python bench/ddp_check.py                  # cpu, gloo
    python3 bench/ddp_check.py --device cuda --layers 24 # a GPU: NCCL, bf16 (Qwen2.5-0.5B's shapes)

Two ranks on one machine are tests/unit/test_train_step.py's (gloo); NCCL refuses two ranks on one GPU.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.trainer_throughput import build_model  # noqa: E402
from trainer.batch import StepData, TrainSequence  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402
from trainer.model import Policy, load_policy, make_optimizer  # noqa: E402
from trainer.step import train_step  # noqa: E402


def step_data(vocab: int, trajectories: int, tokens: int) -> StepData:
    rng = random.Random(0)
    sequences = [
        TrainSequence(
            token_ids=[rng.randrange(3, vocab) for _ in range(tokens)],
            sampled_mask=[0] * (tokens // 4) + [1] * (tokens - tokens // 4),
            logprobs=[None] * (tokens // 4) + [-5.0 + rng.uniform(-1, 1) for _ in range(tokens - tokens // 4)],
            trajectory=i,
        )
        for i in range(trajectories)
    ]
    advantages = torch.tensor([1.0 if i % 2 else -1.0 for i in range(trajectories)])
    return StepData([f"g{i}" for i in range(trajectories // 2)], sequences, advantages, [0.0] * trajectories, 0, 0, 0)


def run(config: TrainConfig, device: torch.device, data: StepData, steps: int) -> tuple[float, float, dict, float]:
    """(loss, grad norm, LoRA, median step seconds after the first) of `steps` steps from the same fresh LoRA."""
    torch.manual_seed(0)
    model = load_policy(config, device, None)
    policy, optimizer = Policy.of(model, config, device), make_optimizer(model, config)
    seconds = []
    for _ in range(steps):
        started = time.perf_counter()
        metrics = train_step(policy, optimizer, data, config, device, pad_id=0)
        seconds.append(time.perf_counter() - started)
    lora = {name: p.detach().float().cpu() for name, p in model.named_parameters() if p.requires_grad}
    timed = sorted(seconds[1:] or seconds)  # the first step builds the kernels' and NCCL's lazy state
    return metrics.loss, metrics.grad_norm, lora, timed[len(timed) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--layers", type=int, default=2, help="layers of Qwen2.5-0.5B's shapes (real vocabulary)")
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per trajectory")
    parser.add_argument("--steps", type=int, default=3, help="steps each way (the median step time is shown)")
    args = parser.parse_args()
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        build_model("real-vocab", model_dir, args.layers)
        config = TrainConfig(base_model=str(model_dir), db="x", learning_rate=1e-4)
        vocab = 151_936
        data = step_data(vocab, args.trajectories, args.tokens)
        alone = run(config, device, data, args.steps)
        again = run(config, device, data, args.steps)  # the device's own run-to-run spread (atomics in kernels)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, rank=0, world_size=1)
        try:
            grouped = run(config, device, data, args.steps)
        finally:
            torch.distributed.destroy_process_group()

    def largest(a: dict, b: dict) -> float:
        return max(float((a[name] - tensor).abs().max()) for name, tensor in b.items())

    difference, spread = largest(alone[2], grouped[2]), largest(alone[2], again[2])
    print(
        f"\n{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
        f"{args.layers} layers, {args.trajectories} x {args.tokens} tokens, {args.steps} steps each\n"
    )
    print("| | loss | grad norm | step s (median) |\n|---|--:|--:|--:|")
    print(f"| alone | {alone[0]:.6f} | {alone[1]:.6f} | {alone[3]:.3f} |")
    print(f"| DDP, {backend}, 1 rank | {grouped[0]:.6f} | {grouped[1]:.6f} | {grouped[3]:.3f} |")
    print(f"| alone, again | {again[0]:.6f} | {again[1]:.6f} | {again[3]:.3f} |")
    print(
        f"\nlargest LoRA difference after {args.steps} steps: alone vs DDP {difference:.3g}, "
        f"alone vs alone {spread:.3g}"
    )
    # The same step up to the device's own run-to-run spread (CPU: none, so exactly).
    same = difference <= max(2 * spread, 1e-6)
    print(f"the same step: {'PASS' if same else 'FAIL'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
