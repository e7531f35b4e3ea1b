"""Log-probabilities of chosen tokens without the full (tokens x vocabulary) logits.

(stub: being written; see chunked_token_logprobs' docstring for the contract)
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["chunked_token_logprobs"]


def chunked_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    token_ids: Tensor,
    *,
    chunk_size: int = 1024,
    allowed_index: Tensor | None = None,
    allowed_bitmask: Tensor | None = None,
) -> Tensor:
    """log softmax(hidden @ weight.T)[token], (N, H), (V, H), (N,) -> (N,), float32 or wider.

    Processes `chunk_size` rows at a time: peak memory ~ chunk_size x V, never N x V.
    Differentiable w.r.t. `hidden` (the output layer `weight` is frozen under LoRA).
    Grammar: `allowed_index` (N,) long, -1 = unconstrained, else a row of `allowed_bitmask` (M, ceil(V / 32))
    int32 (xgrammar's layout: bit j of word w set = token 32 w + j allowed); a constrained row's log-softmax is
    taken over its allowed tokens only, as vLLM's sampler did.
    """
    raise NotImplementedError
