"""Log-probabilities of chosen tokens without the full (tokens x vocabulary) logits.

The output layer of a real model maps every position to ~150k logits: at 4k trained tokens the float32 logits
alone are 2.5 GB, and autograd keeps them (and their gradient) for the backward pass. Here the output layer runs
over `chunk_size` positions at a time and, since its weight is frozen under LoRA, the only gradient needed is
the one w.r.t. the hidden state, which for log softmax(h W^T)[y] is

    d logp / d h = W[y] - softmax(h W^T) @ W

a (hidden size,)-vector per position. The forward pass computes it while the chunk's logits are at hand and
keeps it instead of the logits; the backward pass is a scaling. So the step holds one chunk's logits at a time,
and the output layer costs the same two matmuls per chunk as a plain forward + backward would.

`policy_token_logprobs` runs a (PEFT) causal LM's body and feeds only the trained positions through this.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["chunked_token_logprobs", "policy_token_logprobs"]

# Config attributes (of the text config) that put something other than a plain `hidden @ W.T` in the logits:
# Gemma 2/3's tanh softcap, Cohere's and others' logit multipliers, Granite's/MiniCPM3's divisor. Each maps to
# the value that means "no change" (None: only absent or None is neutral).
_LOGIT_TRANSFORMS: dict[str, float | None] = {
    "final_logit_softcapping": None,
    "logit_scale": 1.0,
    "output_multiplier": 1.0,
    "lm_head_multiplier": 1.0,
    "logits_scaling": 1.0,
}


def chunked_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    token_ids: Tensor,
    *,
    chunk_size: int = 1024,
    allowed_index: Tensor | None = None,
    allowed_bitmask: Tensor | None = None,
    validate: bool = True,
) -> Tensor:
    """log softmax(hidden @ weight.T)[token], (N, H), (V, H), (N,) -> (N,), float32 or wider.

    Processes `chunk_size` rows at a time: peak memory ~ chunk_size x V, never N x V.
    Differentiable w.r.t. `hidden` (the output layer `weight` is frozen under LoRA: a `weight` that requires grad
    is refused, except under no_grad).
    Grammar: `allowed_index` (N,) long, -1 = unconstrained, else a row of `allowed_bitmask` (M, ceil(V / 32))
    int32 (xgrammar's layout: bit j of word w set = token 32 w + j allowed); a constrained row's log-softmax is
    taken over its allowed tokens only, as vLLM's sampler did.
    `validate=False` skips the checks that read values (token ids in range, each token allowed by its mask): each
    is a wait for the device, so the trainer checks its batch once, on the host, instead.
    """
    _check_inputs(hidden, weight, token_ids, chunk_size, allowed_index, allowed_bitmask, validate)
    need_grad = torch.is_grad_enabled() and hidden.requires_grad
    # Function.apply carries no annotations: it returns what forward does.
    logprobs: Tensor = _ChunkedLogprobs.apply(  # type: ignore[no-untyped-call]
        hidden, weight, token_ids, chunk_size, allowed_index, allowed_bitmask, need_grad
    )
    return logprobs


def policy_token_logprobs(
    model: Any,
    input_ids: Tensor,
    position_ids: Tensor,
    attention_mask: Tensor | None,
    labels: Tensor,
    positions: Tensor,
    *,
    chunk_size: int,
    allowed_index: Tensor | None = None,
    allowed_bitmask: Tensor | None = None,
    autocast: torch.dtype | None = None,
    validate: bool = True,
) -> Tensor:
    """log p(labels[b, t]) under `model` (a causal LM, or a PEFT model around one) at `positions`, 0 elsewhere.

    (b, T) inputs -> (b, T), float32 (wider if the model is); `attention_mask` as the model takes it (packed
    rows: (b, 1, T, T) bool; None: plain causal). `positions` (b, T) bool: the tokens to score (the
    trained ones); only they go through the output layer. Given on the host (the trainer's packed batch), they
    are turned into indices there, so that nothing waits for the device to learn how many there are.
    `allowed_index` (b, T) long: -1 = unconstrained, else a row of `allowed_bitmask` (see
    `chunked_token_logprobs`, and its `validate`). `autocast`: the model's body runs under autocast to this
    dtype (bf16 on a GPU); the output layer and the log-softmax never do. Runs the LoRA layers as they are set, so
    under `model.disable_adapter()` this is the base model.
    """
    if positions.shape != labels.shape or positions.dtype != torch.bool:
        raise ValueError(
            f"positions must be a bool tensor shaped like labels {tuple(labels.shape)}, "
            f"got {positions.dtype} {tuple(positions.shape)}"
        )
    if allowed_index is not None and allowed_index.shape != labels.shape:
        raise ValueError(
            f"allowed_index must be shaped like labels {tuple(labels.shape)}, got {tuple(allowed_index.shape)}"
        )
    causal_lm = _causal_lm(model)
    with torch.autocast(input_ids.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = causal_lm.get_decoder()(
            input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=False
        )
    index = positions.reshape(-1).nonzero()[:, 0].to(input_ids.device, non_blocking=True)  # (n,)
    hidden = out.last_hidden_state.flatten(0, 1).index_select(0, index)  # (n, H): only these reach the output
    logprobs = chunked_token_logprobs(
        hidden,
        causal_lm.get_output_embeddings().weight,
        labels.reshape(-1).index_select(0, index),
        chunk_size=chunk_size,
        allowed_index=None if allowed_index is None else allowed_index.reshape(-1).index_select(0, index),
        allowed_bitmask=allowed_bitmask,
        validate=validate,
    )
    # A fresh zero tensor written through `index`: differentiable w.r.t. logprobs, 0 (no gradient) elsewhere.
    return logprobs.new_zeros(labels.numel()).index_copy(0, index, logprobs).view(labels.shape)


# -----------------------------------------------------------------------------
# the autograd function


class _ChunkedLogprobs(torch.autograd.Function):
    """Forward computes log p(y) and, when needed, d log p(y) / d hidden per row; backward only scales the latter."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        token_ids: Tensor,
        chunk_size: int,
        allowed_index: Tensor | None,
        allowed_bitmask: Tensor | None,
        need_grad: bool,
    ) -> Tensor:
        dtype = _compute_dtype(hidden, weight)
        # Upcast once per call (no copy when already float32): bf16 logits lose the small probabilities, which
        # the importance ratio needs (a bf16 logit of ~10 is off by ~0.01 nats). On a GPU the float32 copy of a
        # bf16 W (V x H, 544 MB for Qwen2's vocabulary at H = 896) is small beside the logits it replaces.
        w = weight.to(dtype)
        n, vocab = hidden.shape[0], weight.shape[0]
        logprobs = torch.empty(n, dtype=dtype, device=hidden.device)
        jacobian = torch.empty((n, hidden.shape[1]), dtype=dtype, device=hidden.device) if need_grad else None
        masked = allowed_index is not None and allowed_bitmask is not None and allowed_bitmask.shape[0] > 0
        # The only chunk-by-vocabulary tensor, allocated once: a fresh one per chunk would be page-faulted in anew.
        buffer = torch.empty((min(chunk_size, n), vocab), dtype=dtype, device=hidden.device)
        for start in range(0, n, chunk_size):
            rows = slice(start, min(start + chunk_size, n))
            y = token_ids[rows]
            logits = torch.mm(hidden[rows].to(dtype), w.T, out=buffer[: y.shape[0]])  # (c, V)
            if masked:
                assert allowed_index is not None and allowed_bitmask is not None  # for the type checker
                logits.masked_fill_(~_allowed(allowed_index[rows], allowed_bitmask, vocab), float("-inf"))
            # log-softmax and softmax in place: no second (c, V) tensor.
            logits.sub_(logits.amax(dim=1, keepdim=True))
            chosen = logits.gather(1, y[:, None])[:, 0]
            sums = logits.exp_().sum(dim=1)
            logprobs[rows] = chosen - sums.log()
            if jacobian is not None:
                probs = logits.div_(sums[:, None])
                torch.addmm(w[y], probs, w, alpha=-1, out=jacobian[rows])  # W[y] - softmax @ W
        ctx.hidden_dtype = hidden.dtype
        if jacobian is not None:
            ctx.save_for_backward(jacobian)
        return logprobs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        (jacobian,) = ctx.saved_tensors
        grad_hidden = (grad_output[:, None] * jacobian).to(ctx.hidden_dtype)
        return grad_hidden, None, None, None, None, None, None


# -----------------------------------------------------------------------------
# helpers


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """float32, or wider when an input is (float64 for tests and gradcheck)."""
    return torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)


_BYTE_SHIFTS = (0, 8, 16, 24)


def _allowed(index: Tensor, bitmask: Tensor, vocab: int) -> Tensor:
    """(c,) rows of the bitmask (-1: all allowed) -> (c, vocab) bool: True = allowed."""
    words = bitmask[index.clamp(min=0)]  # (c, W) int32
    # Words -> bytes by arithmetic (byte-order independent), then bytes -> bits: the intermediates are c x V / 2
    # and c x V bytes, where unpacking int32 words straight into 32 int32 bit planes would take c x V x 4.
    byte_shifts = torch.tensor(_BYTE_SHIFTS, dtype=torch.int32, device=words.device)
    bytes_ = ((words[:, :, None] >> byte_shifts) & 0xFF).to(torch.uint8)  # (c, W, 4): byte k = bits 8k..8k+7
    bit_shifts = torch.arange(8, dtype=torch.uint8, device=words.device)
    bits = (bytes_[:, :, :, None] >> bit_shifts) & 1  # (c, W, 4, 8): token 32 w + 8 k + b
    allowed = bits.view(words.shape[0], -1)[:, :vocab].bool()
    return allowed | (index < 0)[:, None]


def _token_allowed(token_ids: Tensor, index: Tensor, bitmask: Tensor) -> Tensor:
    """(N,) bool: each token is allowed by its own row's mask (or the row is unconstrained)."""
    words = bitmask[index.clamp(min=0), token_ids >> 5]
    # An arithmetic shift of a negative word still leaves bit 31 in the lowest place.
    return ((words >> (token_ids & 31)) & 1).bool() | (index < 0)


def _check_inputs(
    hidden: Tensor,
    weight: Tensor,
    token_ids: Tensor,
    chunk_size: int,
    allowed_index: Tensor | None,
    allowed_bitmask: Tensor | None,
    validate: bool,
) -> None:
    """ValueError for anything `chunked_token_logprobs` cannot compute exactly (values too, if `validate`)."""
    if hidden.ndim != 2 or not hidden.is_floating_point():
        raise ValueError(f"hidden must be an (N, H) float tensor, got {hidden.dtype} {tuple(hidden.shape)}")
    if weight.ndim != 2 or not weight.is_floating_point() or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight must be a (V, {hidden.shape[1]}) float tensor, got {weight.dtype} {tuple(weight.shape)}"
        )
    # Under no_grad nothing flows back, so a trainable weight is only refused where its gradient would be lost.
    if weight.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "weight requires grad: training the output layer is not supported (only d/d hidden is computed); "
            "freeze it (LoRA does) or use full logits"
        )
    if token_ids.shape != (hidden.shape[0],) or token_ids.dtype != torch.long:
        raise ValueError(
            f"token_ids must be a long tensor of shape ({hidden.shape[0]},), got {token_ids.dtype} "
            f"{tuple(token_ids.shape)}"
        )
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if len({hidden.device, weight.device, token_ids.device}) != 1:
        raise ValueError(
            f"hidden, weight and token_ids must be on one device, got {hidden.device}, {weight.device}, "
            f"{token_ids.device}"
        )
    vocab = weight.shape[0]
    if validate and token_ids.numel() and ((token_ids < 0) | (token_ids >= vocab)).any():
        raise ValueError(f"token_ids must be in [0, {vocab}), got {token_ids.min()}..{token_ids.max()}")
    if (allowed_index is None) != (allowed_bitmask is None):
        raise ValueError("allowed_index and allowed_bitmask go together: pass both or neither")
    if allowed_index is None or allowed_bitmask is None:
        return
    words = (vocab + 31) // 32
    if allowed_bitmask.ndim != 2 or allowed_bitmask.dtype != torch.int32 or allowed_bitmask.shape[1] != words:
        raise ValueError(
            f"allowed_bitmask must be an (M, {words}) int32 tensor (vocabulary {vocab}), got "
            f"{allowed_bitmask.dtype} {tuple(allowed_bitmask.shape)}"
        )
    if allowed_index.shape != token_ids.shape or allowed_index.dtype != torch.long:
        raise ValueError(
            f"allowed_index must be a long tensor of shape {tuple(token_ids.shape)}, got {allowed_index.dtype} "
            f"{tuple(allowed_index.shape)}"
        )
    if allowed_index.device != hidden.device or allowed_bitmask.device != hidden.device:
        raise ValueError("allowed_index and allowed_bitmask must be on hidden's device")
    masks = allowed_bitmask.shape[0]
    if not validate:
        return
    if token_ids.numel() and ((allowed_index < -1) | (allowed_index >= masks)).any():
        raise ValueError(f"allowed_index must be -1 or a row of allowed_bitmask, in [-1, {masks})")
    if token_ids.numel() and masks:
        bad = (~_token_allowed(token_ids, allowed_index, allowed_bitmask)).nonzero()[:, 0].tolist()
        if bad:
            raise ValueError(
                f"row {bad[0]}: token {int(token_ids[bad[0]])} is not allowed by its grammar mask (row "
                f"{int(allowed_index[bad[0]])}; {len(bad)} such rows): the grammar does not match what was sampled"
            )


def _causal_lm(model: Any) -> Any:
    """The causal LM inside `model` (a PEFT model's base, LoRA layers in place), checked to have plain logits."""
    peft_config = getattr(model, "active_peft_config", None)
    if peft_config is not None and peft_config.is_prompt_learning:
        raise ValueError("prompt-learning PEFT adds virtual tokens in its own forward: not supported")
    causal_lm = model.get_base_model() if peft_config is not None else model
    head = causal_lm.get_output_embeddings()
    # An exact nn.Linear: a PEFT layer wrapping the head (a LoRA on lm_head) would add a delta we'd skip.
    # getattr: torch types Linear.bias as always a Parameter (it is None when built with bias=False).
    if type(head) is not torch.nn.Linear or getattr(head, "bias", None) is not None:
        raise ValueError(
            f"the output layer must be a plain nn.Linear without bias (logits = hidden @ W.T), got {head!r}"
        )
    config = causal_lm.config.get_text_config()
    for name, neutral in _LOGIT_TRANSFORMS.items():
        value = getattr(config, name, None)
        if value is not None and value != neutral:
            raise ValueError(f"{type(causal_lm).__name__} transforms its logits ({name}={value}): not supported")
    return causal_lm
