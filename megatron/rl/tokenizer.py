"""The tokenizer protocol and the character tokenizer of the built-in environments.

``Tokenizer``: what the inference side needs. ``CharTokenizer``: one token per character, plus
EOS and PAD. A local Hugging Face tokenizer directory behind the same protocol is
``megatron.rl.models.hf.tokenizer.HuggingFaceTokenizer``.
"""

from __future__ import annotations

from typing import Protocol

DEFAULT_ALPHABET = "0123456789+-*=:,.? "


class Tokenizer(Protocol):
    """What the inference side needs from a tokenizer."""

    eos_id: int
    pad_id: int
    extra_stop_ids: tuple[int, ...]
    """Tokens besides ``eos_id`` that end a generation."""

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_continuation(self, text: str) -> list[int]:
        """Token ids of ``text`` appended to a sequence (no BOS or other leading specials)."""
        ...

    def decode(self, tokens: list[int]) -> str: ...


class CharTokenizer:
    """Maps each character of a fixed alphabet to one token id.

    Ids: 0 is PAD, 1 is EOS, then the alphabet in order. Text with a character outside the
    alphabet is rejected with an error naming the character, never silently dropped.
    """

    pad_id = 0
    eos_id = 1
    extra_stop_ids: tuple[int, ...] = ()

    def __init__(self, alphabet: str = DEFAULT_ALPHABET) -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError(f"tokenizer alphabet has repeated characters: {alphabet!r}")
        self.alphabet = alphabet
        self._ids = {ch: i + 2 for i, ch in enumerate(alphabet)}

    @property
    def vocab_size(self) -> int:
        """Number of real token ids (before any padding of the embedding table)."""
        return len(self.alphabet) + 2

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; raises ValueError on a character outside the alphabet."""
        try:
            return [self._ids[ch] for ch in text]
        except KeyError as err:
            raise ValueError(
                f"character {err.args[0]!r} is not in the tokenizer alphabet {self.alphabet!r}"
            ) from None

    def encode_continuation(self, text: str) -> list[int]:
        """Same as ``encode``: this tokenizer adds no special tokens."""
        return self.encode(text)

    def decode(self, tokens: list[int]) -> str:
        """Text of ``tokens``, stopping at the first EOS and skipping PAD."""
        chars = []
        for tok in tokens:
            if tok == self.eos_id:
                break
            if tok == self.pad_id:
                continue
            if not 2 <= tok < self.vocab_size:
                raise ValueError(f"token id {tok} is outside the vocabulary [0, {self.vocab_size})")
            chars.append(self.alphabet[tok - 2])
        return "".join(chars)
