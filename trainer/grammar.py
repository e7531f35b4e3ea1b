"""The grammar vLLM sampled a call under, rebuilt from the recorded request, as per-token allowed-token masks.

(stub: being written; see GrammarMasks' docstring for the contract)
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

__all__ = ["GrammarMasks"]


class GrammarMasks:
    """Built once per trainer (per tokenizer); compiled grammars are cached by their spec."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        raise NotImplementedError

    def for_call(self, request: dict[str, Any], sampled_token_ids: list[int]) -> Tensor | None:
        """(n, ceil(vocab_size / 32)) int32: row i = the tokens the grammar allowed when sampled_token_ids[i]
        was sampled (xgrammar's bitmask layout). None when the request samples under no grammar."""
        raise NotImplementedError
