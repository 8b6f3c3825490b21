"""Tokenizers: a built-in character tokenizer for the synthetic tasks, and HF tokenizers."""

from __future__ import annotations

import os
import string
from collections.abc import Iterable

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
CHARS = string.digits + "+-*/=()<>,.:;?!%^_[]'" + string.ascii_letters + " \n"


class CharTokenizer:
    """One id per character of ``CHARS`` (digits, operators, letters, space, newline) after
    three special ids: ``pad_id=0``, ``bos_id=1``, ``eos_id=2``."""

    def __init__(self, chars: str = CHARS):
        if len(set(chars)) != len(chars):
            raise ValueError(f"chars: {chars!r} holds duplicates")
        self.specials = (PAD, BOS, EOS)
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2
        self.chars = chars
        self._to_id = {c: i + len(self.specials) for i, c in enumerate(chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.specials) + len(self.chars)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """ids of ``text``; an unknown character raises ValueError naming it."""
        ids = []
        for pos, c in enumerate(text):
            if c not in self._to_id:
                raise ValueError(
                    f"text: character {c!r} at position {pos} is not in the CharTokenizer "
                    f"alphabet {self.chars!r}"
                )
            ids.append(self._to_id[c])
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """Text of ``ids``; specials are dropped (or written as ``<pad>`` etc.)."""
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"ids: {i} is outside [0, vocab_size={self.vocab_size})")
            if i < len(self.specials):
                if not skip_special:
                    out.append(self.specials[i])
            else:
                out.append(self.chars[i - len(self.specials)])
        return "".join(out)


def load_hf_tokenizer(path: str | os.PathLike):
    """transformers ``AutoTokenizer`` from a local directory (never downloads)."""
    if not os.path.isdir(path):
        raise ValueError(f"path: {str(path)!r} is not a directory holding tokenizer files")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
