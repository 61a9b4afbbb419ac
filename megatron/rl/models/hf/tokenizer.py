"""``HuggingFaceTokenizer``: a local Hugging Face tokenizer directory (``tokenizer.json`` etc.,
loaded with transformers' ``AutoTokenizer``, never downloaded) behind the project's ``Tokenizer``
protocol (``megatron/rl/tokenizer.py``), plus BOS, the stop ids of ``generation_config.json`` and
the chat template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron.rl.models.hf.errors import HFCheckpointError


class HuggingFaceTokenizer:
    """A local Hugging Face tokenizer directory behind the project's ``Tokenizer`` protocol.

    * ``encode`` adds the tokenizer's own special tokens (e.g. Llama's BOS) when
      ``add_special_tokens`` is true; ``encode_chat`` renders the chat template and encodes it
      without adding them again (the template writes them).
    * ``eos_id`` is the tokenizer's EOS token; ``stop_ids`` adds every id of
      ``generation_config.json``'s ``eos_token_id`` (an int or a list: Llama 3 instruct models
      stop at ``<|eot_id|>`` too); ``extra_stop_ids`` are those other than ``eos_id``.
    * ``pad_id`` is the PAD token, or ``eos_id`` when the tokenizer has none (Llama).
    * ``decode`` stops at the first stop id and drops special tokens, like ``CharTokenizer``.

    Errors (missing directory, no EOS token, no chat template) are ``HFCheckpointError``
    naming the directory.
    """

    def __init__(self, directory: str | Path, add_special_tokens: bool = True) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise HFCheckpointError(f"tokenizer directory {self.directory} does not exist")
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(str(self.directory), local_files_only=True)
        except Exception as err:  # transformers raises OSError, ValueError, KeyError, ...
            raise HFCheckpointError(
                f"{self.directory}: cannot load a Hugging Face tokenizer ({err})"
            ) from err
        if self._tok.eos_token_id is None:
            raise HFCheckpointError(f"{self.directory}: the tokenizer has no eos_token")
        self.add_special_tokens = add_special_tokens
        self.eos_id: int = self._tok.eos_token_id
        self.pad_id: int = (
            self._tok.pad_token_id if self._tok.pad_token_id is not None else self.eos_id
        )
        self.bos_id: int | None = self._tok.bos_token_id
        stops = [self.eos_id]
        for tok in _generation_eos_ids(self.directory):
            if tok not in stops:
                stops.append(tok)
        self.stop_ids: tuple[int, ...] = tuple(stops)
        self.extra_stop_ids: tuple[int, ...] = tuple(stops[1:])

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added special tokens included."""
        return len(self._tok)

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template, or None."""
        return self._tok.chat_template

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's special tokens if configured)."""
        return list(self._tok.encode(text, add_special_tokens=self.add_special_tokens))

    def encode_continuation(self, text: str) -> list[int]:
        """Token ids of ``text`` appended to a sequence: no special tokens (no second BOS)."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, tokens: list[int]) -> str:
        """Text of ``tokens`` up to the first stop id, special tokens dropped."""
        stops = set(self.stop_ids)
        end = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
        return self._tok.decode(list(tokens[:end]), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """The text of one token, special tokens included (``decode`` drops them)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text of ``messages`` ({"role", "content", ...} dicts) rendered by the
        template, with ``tools`` (OpenAI function schemas) where the template renders them."""
        if not self._tok.chat_template:
            raise HFCheckpointError(
                f"{self.directory}: the tokenizer has no chat_template, so chat messages cannot be "
                "turned into a prompt (use plain-text prompts or add a chat template)"
            )
        return self._tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of the chat prompt of ``messages`` (no special tokens added twice)."""
        text = self.apply_chat_template(messages, tools=tools)
        return list(self._tok.encode(text, add_special_tokens=False))


def _generation_eos_ids(directory: Path) -> list[int]:
    """``eos_token_id`` of ``directory/generation_config.json`` as a list (empty if absent)."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return []
    value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
