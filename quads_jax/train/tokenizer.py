"""The tokenizer the trainer uses: the built-in char tokenizer or a local HF tokenizer, behind
one small interface (``encode(text, add_bos, add_eos)``, ``decode(ids)``, ``pad_id``,
``bos_id``, ``eos_id``, ``vocab_size``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from quads_jax.tokenizers import CharTokenizer, load_hf_tokenizer


class HFTokenizerAdapter:
    """A transformers tokenizer with the char tokenizer's interface (no chat template)."""

    def __init__(self, tok: Any):
        self.tok = tok
        self.eos_id = tok.eos_token_id
        if self.eos_id is None:
            raise ValueError(f"tokenizer {tok.name_or_path!r} has no eos_token_id; RL needs one")
        self.bos_id = tok.bos_token_id
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.eos_id
        self.vocab_size = len(tok)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False)
        bos = [self.bos_id] if add_bos and self.bos_id is not None else []
        return bos + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(name: str):
    """``"char"`` -> :class:`CharTokenizer`; otherwise a local HF tokenizer directory."""
    if name == "char":
        return CharTokenizer()
    return HFTokenizerAdapter(load_hf_tokenizer(name))
