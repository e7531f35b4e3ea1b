"""Token ids as text, for the token view: the base model's own tokenizer, loaded once, lazily.

The gateway needs no tokenizer to serve (vLLM tokenizes); the UI only shows what was recorded. The tokenizer is
read with `tokenizers` (installed with vLLM and the trainer) from `tokenizer.json` in the base model's directory.
A base model given as a hub id, a directory without that file or a gateway without `tokenizers`: ids only.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Protocol

import anyio.to_thread

log = logging.getLogger("artgw.ui")


class Decoder(Protocol):
    def pieces(self, token_ids: list[int]) -> list[str]: ...


class IdsOnly:
    """No tokenizer at hand: each token shown as its id."""

    def pieces(self, token_ids: list[int]) -> list[str]:
        return [f"⟨{token_id}⟩" for token_id in token_ids]


class TokenizerDecoder:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer  # a heavy import, and optional: only when a page shows tokens

        self.tokenizer = Tokenizer.from_file(str(path))

    def pieces(self, token_ids: list[int]) -> list[str]:
        """Each token decoded alone (a byte-level token that is part of a character shows as U+FFFD)."""
        texts = self.tokenizer.decode_batch([[t] for t in token_ids], skip_special_tokens=False)
        return [text or (self.tokenizer.id_to_token(t) or f"⟨{t}⟩") for t, text in zip(token_ids, texts, strict=True)]


@functools.cache
def _load(base_model_path: str | None) -> Decoder:
    path = Path(base_model_path) / "tokenizer.json" if base_model_path else None
    if path is None or not path.is_file():
        return IdsOnly()
    try:
        return TokenizerDecoder(path)
    except Exception as exc:  # no `tokenizers`, or a file it cannot read: the ids still tell the truth
        log.warning("token view shows ids only: could not load %s: %s", path, exc)
        return IdsOnly()


async def decoder_for(base_model_path: str | None) -> Decoder:
    """The decoder of the base model at `base_model_path` (read once per path, off the event loop)."""
    return await anyio.to_thread.run_sync(_load, base_model_path)
