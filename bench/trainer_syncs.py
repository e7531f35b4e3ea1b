"""Where the trainer's step waits for the GPU: one step under torch.cuda.set_sync_debug_mode("warn"), each
synchronizing operation attributed to the innermost frame of this project's code (or of the library below it)
that asked for it. CUDA only.

    python3 bench/trainer_syncs.py --layers 2 --trajectories 8 --tokens 256
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.ddp_check import step_data  # noqa: E402
from bench.trainer_throughput import build_model  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402
from trainer.model import Policy, load_policy, make_optimizer  # noqa: E402
from trainer.step import train_step  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--trajectories", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--loss", default="ppo", help="--loss of artgw train (ppo, cispo, gspo)")
    args = parser.parse_args()
    device = torch.device("cuda")
    with tempfile.TemporaryDirectory() as tmp:
        build_model("real-vocab", Path(tmp) / "model", args.layers)
        config = TrainConfig(base_model=str(Path(tmp) / "model"), db="x", loss_name=args.loss)
        model = load_policy(config, device, None)
        policy, optimizer = Policy.of(model, config, device), make_optimizer(model, config)
        data = step_data(151_936, args.trajectories, args.tokens)
        train_step(policy, optimizer, data, config, device, pad_id=0)  # warm: lazy state built
        sites: collections.Counter[str] = collections.Counter()

        def note(message, category, filename, lineno, file=None, line=None):
            if "synchronizing" not in str(message):
                return
            frames = [f for f in traceback.extract_stack()[:-1] if "/warnings.py" not in f.filename]
            ours = [f for f in frames if str(ROOT) in f.filename and "/bench/" not in f.filename]
            where = ours[-1] if ours else frames[-1]
            below = frames[frames.index(where) + 1] if where is not frames[-1] else where
            sites[f"{Path(where.filename).name}:{where.lineno} -> {Path(below.filename).name}:{below.lineno}"] += 1

        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = note
            train_step(policy, optimizer, data, config, device, pad_id=0)
        torch.cuda.set_sync_debug_mode(0)
    print(f"\n{sum(sites.values())} synchronizing operations in one step ({args.loss}):")
    for site, count in sites.most_common():
        print(f"  {count:3d}  {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
