"""The policy: a LoRA on the base model, the module the loss calls (one per process, under DistributedDataParallel
when there are several), its optimizer.

Precision: on CUDA the base loads in bf16 and the body runs under bf16 autocast (PEFT keeps the LoRA weights in
float32); log-probabilities and the loss are float32 or wider (trainer/logprobs.py). On CPU everything is float32.
Gradient checkpointing ("auto"): on for a base of GRADIENT_CHECKPOINTING_FROM parameters or more.
torch.compile is not used: the packed rows change shape every step (recompiles), and the output layer, the
step's largest cost at a real vocabulary, is already two plain matmuls per chunk.
"""

from __future__ import annotations

import resource
import warnings
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from trainer import distributed
from trainer.config import TrainConfig
from trainer.logprobs import policy_token_logprobs

# Below ~1B parameters the activations of a default micro-batch (8 rows x 512 tokens) fit beside the weights on
# any 16 GB GPU, and recomputing them would cost ~a third more time; from there on they grow with layers x hidden
# size past what a 24 GB card holds, so the body's activations are recomputed in the backward pass instead.
GRADIENT_CHECKPOINTING_FROM = 1_000_000_000


def pick_device(config: TrainConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(config.device)


def compute_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the device does it well, float32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32


def load_policy(config: TrainConfig, device: torch.device, adapter_dir: Any = None) -> Any:  # -> PeftModel
    """The base model with a LoRA: the one in `adapter_dir` (trainable), else a fresh one from config's seed."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(
        config.base_model, dtype=compute_dtype(device), attn_implementation="sdpa"
    )
    size = sum(p.numel() for p in base.parameters())
    if config.gradient_checkpointing == "on" or (
        config.gradient_checkpointing == "auto" and size >= GRADIENT_CHECKPOINTING_FROM
    ):
        # Non-reentrant: it works under DDP (the reentrant form marks a LoRA gradient ready twice) and needs no
        # input that requires grad.
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)
    else:
        lora = LoraConfig(
            r=config.lora_rank,
            lora_alpha=config.lora_alpha,
            lora_dropout=config.lora_dropout,
            target_modules=list(config.target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(base, lora)
    return model.to(device)


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params, lr=config.learning_rate, betas=(config.beta1, config.beta2), weight_decay=config.weight_decay
    )


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class TokenLogprobs(torch.nn.Module):
    """log pi(label) of the trained tokens of packed rows: the one forward the loss needs, as a module, so that
    DistributedDataParallel can wrap it (its hooks see this forward and the LoRA's gradients)."""

    def __init__(self, model: Any, chunk_size: int, autocast: torch.dtype | None) -> None:
        super().__init__()
        self.model = model  # the PeftModel: its LoRA is what trains
        self.chunk_size = chunk_size
        self.autocast = autocast

    def forward(
        self,
        input_ids: Tensor,  # (b, T)
        position_ids: Tensor,  # (b, T)
        attention_mask: Tensor,  # (b, 1, T, T) bool
        labels: Tensor,  # (b, T)
        positions: Tensor,  # (b, T) bool, on the host: the trained tokens
        allowed_index: Tensor | None = None,  # (b, T) long: grammar rows, -1 unconstrained
        allowed_bitmask: Tensor | None = None,  # (M, ceil(V / 32)) int32
    ) -> Tensor:  # (b, T), 0 off `positions`
        return policy_token_logprobs(
            self.model,
            input_ids,
            position_ids,
            attention_mask,
            labels,
            positions,
            chunk_size=self.chunk_size,
            allowed_index=allowed_index,
            allowed_bitmask=allowed_bitmask,
            autocast=self.autocast,
            validate=False,  # the step checks its batch once, on the host (trainer/step.py)
        )


@dataclass
class Policy:
    """A model's LoRA and the module that computes its log-probabilities (DDP around it in a process group)."""

    model: Any  # PeftModel
    logprobs: torch.nn.Module  # TokenLogprobs, or DistributedDataParallel(TokenLogprobs)

    @classmethod
    def of(cls, model: Any, config: TrainConfig, device: torch.device) -> Policy:
        autocast = torch.bfloat16 if compute_dtype(device) == torch.bfloat16 else None
        module = TokenLogprobs(model, config.logprob_chunk_tokens, autocast)
        if not distributed.active():
            return cls(model, module)
        from torch.nn.parallel import DistributedDataParallel

        with warnings.catch_warnings():  # newer torch names it forward_sync_buffers, which older ones lack
            warnings.filterwarnings("ignore", "`broadcast_buffers` is deprecated", FutureWarning)
            ddp = DistributedDataParallel(
                module,
                device_ids=[device.index if device.index is not None else torch.cuda.current_device()]
                if device.type == "cuda"
                else None,
                broadcast_buffers=False,  # the base's buffers (rotary tables) are the same everywhere and frozen
                init_sync=False,  # every rank built the same LoRA; distributed.broadcast_parameters sends only it
                gradient_as_bucket_view=True,  # the gradients live in the buckets: no copy in and out
            )
        ddp.register_comm_hook(None, _sum_gradients)
        return cls(model, ddp)

    def accumulating(self, last: bool) -> AbstractContextManager[Any]:
        """Around a micro-batch's forward and backward: gradients stay local until the step's last one."""
        if last or not isinstance(self.logprobs, torch.nn.parallel.DistributedDataParallel):
            return nullcontext()
        return self.logprobs.no_sync()


def _sum_gradients(_state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations as objects
    """DDP's communication hook: the gradients' *sum* over processes (DDP's default averages). Each process's loss
    is its share of the whole batch's (the normalizers are the batch's), so the sum is the batch's gradient.
    `bucket`: a dist.GradBucket; returns a torch.futures.Future of the summed buffer."""
    future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return future.then(lambda done: done.value()[0])


def pad_token_id(config: TrainConfig) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.base_model)
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
