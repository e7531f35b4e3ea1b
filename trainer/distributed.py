"""Several training processes (`artgw train --nproc-per-node N`, `--nnodes M`): the torch.distributed plumbing.

`launch` runs torch's elastic agent inside the CLI process (what `torchrun` does): it starts nproc_per_node
workers on this machine, each running trainer/train.py's `main` as one rank of the group (gloo on CPU, NCCL on
CUDA). Rank 0 alone talks to the store and the gateway; it tells the other ranks what to do with `share`
(trainer/ranks.py), and DistributedDataParallel sums the gradients (trainer/model.py). When a worker dies, the
agent stops the others and starts the whole group again (up to MAX_RESTARTS times); the new rank 0 gives back
what the dead attempt had claimed (`owner`, `owner_prefix`) and resumes from the last committed step, so no group
is trained twice.

With one process on one machine none of this runs: every helper here is a no-op outside a process group.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import socket
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainer.config import TrainConfig

log = logging.getLogger("artgw.trainer")

MAX_RESTARTS = 3  # restarts of the whole group after a worker dies, before `artgw train` gives up
# Ranks > 0 wait in a broadcast for as long as rank 0 waits for ready groups, which may be hours. A dead peer is
# noticed by the elastic agent watching the processes, not by this timeout.
COLLECTIVE_TIMEOUT = timedelta(days=30)


class LaunchFailed(RuntimeError):
    """A worker kept failing: the group was restarted MAX_RESTARTS times."""


def active() -> bool:
    """True inside a process group (a worker of `launch`)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def is_lead() -> bool:
    """Rank 0, or the only process: the one that claims groups, saves checkpoints and commits."""
    return rank() == 0


def share(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (the others pass None): pickled, so any Python object."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_parameters(model: torch.nn.Module) -> None:
    """Rank 0's trainable parameters on every rank. Every rank built the same ones (same seed, same checkpoint);
    this is cheap for a LoRA and rules out any drift between them."""
    if not active():
        return
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                dist.broadcast(param.data, src=0)


def barrier() -> None:
    if active():
        dist.barrier()


def owner_prefix() -> str:
    """What every attempt of this launch's rank 0 puts first in its lease owner: host and elastic run id, the
    same across the group's restarts (and across nodes' views, the run id being one per launch)."""
    return f"{socket.gethostname()}:{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}:"


def owner() -> str:
    """This attempt's lease owner. The restart count makes it differ from the dead attempt's, so a commit that
    attempt left in flight cannot mark groups this one re-claimed (the gateway checks the owner)."""
    return owner_prefix() + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def init(config: TrainConfig) -> None:
    """Join the group the elastic agent set up (RANK, WORLD_SIZE, MASTER_ADDR/PORT are in the environment)."""
    cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if cuda:  # one GPU per local rank: "cuda" then means this rank's own
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # rendezvous, PrefixStore: torch.distributed imports them without listing them in an __all__.
    store, rank, world_size = next(dist.rendezvous("env://"))  # type: ignore[attr-defined]
    # The agent's store outlives a restart of the group: what the dead attempt's ranks wrote there (where to
    # reach them) would be read as this attempt's, and the ranks would call dead ports (pytorch#135712). Each
    # attempt gets keys of its own.
    attempt = dist.PrefixStore(  # type: ignore[attr-defined]
        f"artgw-attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store
    )
    dist.init_process_group(
        "nccl" if cuda else "gloo", store=attempt, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT
    )


def destroy(clean: bool) -> None:
    """Leave the group. After a clean end (every rank past its last collective) wait for the others first, so
    no rank closes its connections while a peer still reads the last order. Then collect what still holds the
    group (DDP modules sit in reference cycles) before destroying it: a process group freed only at interpreter
    exit can abort the process ("terminate called without an active exception", a gloo thread left joinable)."""
    if not active():
        return
    if clean:
        dist.barrier()
    gc.collect()
    dist.destroy_process_group()


def _worker(main: Callable[[TrainConfig], int], config: TrainConfig) -> int:
    """One rank: what the elastic agent runs in each process it starts."""
    init(config)
    clean = False
    try:
        code = main(config)
        clean = True
        return code
    finally:
        destroy(clean)


def launch(config: TrainConfig, main: Callable[[TrainConfig], int]) -> None:
    """Run `main` (trainer/train.py's, which imports this module) in config.nproc_per_node processes on this node
    (of config.nnodes), restarting the whole group when one dies. Returns when they are done or stopped by a
    signal; LaunchFailed when they keep failing."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if config.nnodes == 1:
        # `torchrun --standalone`: the rendezvous store on a free local port, so trainers on one machine never meet.
        backend, endpoint, run_id, rdzv = "c10d", "localhost:0", uuid.uuid4().hex[:12], {}
    else:
        # `torchrun --nnodes M --node-rank R --master-addr A --master-port P`: node 0 hosts the store, and every
        # node derives the same run id from where they meet.
        backend, endpoint, rdzv = "static", f"{config.master_addr}:{config.master_port}", {"rank": config.node_rank}
        run_id = f"artgw-{config.master_addr}-{config.master_port}"
    if "OMP_NUM_THREADS" not in os.environ:  # as torchrun, but each worker gets its share of the cores, not 1
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // config.nproc_per_node))
    launch_config = LaunchConfig(
        min_nodes=config.nnodes,
        max_nodes=config.nnodes,
        nproc_per_node=config.nproc_per_node,
        run_id=run_id,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv,
        max_restarts=MAX_RESTARTS,
        monitor_interval=0.5,
        start_method="spawn",  # CUDA cannot be forked
        # SIGINT and SIGTERM are ours (`forward`): the agent's own handling stops watching the workers, so one
        # that returns waits for the agent to collect its result until it is SIGKILLed 30 s later.
        signals_to_handle="SIGHUP,SIGQUIT",
    )

    def forward(signum: int, _frame: object) -> None:
        # The workers stop as one process does, finishing or abandoning the step in hand (rank 0 tells the others
        # when), and return; the agent collects them. They may have had it already: one Ctrl-C reaches them all.
        for child in multiprocessing.active_children():
            if child.pid is not None:  # always set on a started (active) child
                os.kill(child.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        elastic_launch(launch_config, _worker)(main, config)
    except SignalException as exc:  # SIGHUP/SIGQUIT: the agent passed it on and ended the workers
        log.info("artgw train stopped by %s", exc.sigval.name)
    except ChildFailedError as exc:
        failed, failure = exc.get_first_failure()
        raise LaunchFailed(
            f"rank {failed} failed (exit code {failure.exitcode}) after {MAX_RESTARTS} restarts of the group; "
            "its traceback is in the log above"
        ) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
