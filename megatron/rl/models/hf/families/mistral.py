"""Mistral (``MistralForCausalLM``, ``model_type: mistral``).

* ``config.json``: every layer attends within ``sliding_window`` (default 4096): a window shorter
  than ``max_position_embeddings`` is refused (it would mask keys that full attention sees), a
  longer one never masks a key of a sequence the model supports and is accepted as full
  attention; no biases (``attention_bias: true`` is refused); ``max_position_embeddings``
  defaults to 131072.
* Tensors: the common ones.
* Export: writes ``sliding_window: null``; never chosen for an architecture without a checkpoint
  (Llama writes the same model).
* Tiny model ``mistral``: grouped-query attention, ``sliding_window`` equal to
  ``max_position_embeddings`` (accepted: it never masks); its tokenizer adds BOS.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from megatron.rl.models.hf.families.base import HFFamily, TinyRecipe

if TYPE_CHECKING:
    from megatron.rl.models.architecture import GPTArchitecture


def sliding_window(cfg: Mapping[str, Any]) -> tuple[int | None, bool]:
    """Every layer slides, over 4096 keys unless ``config.json`` says otherwise."""
    return cfg.get("sliding_window", 4096), True


def config_keys(arch: GPTArchitecture) -> dict[str, Any]:
    """Full attention."""
    return {"sliding_window": None}


def tiny(common: dict[str, Any]) -> dict[str, Any]:
    """A window as long as the context: accepted, never masks."""
    return {"sliding_window": common["max_position_embeddings"]}


FAMILY = HFFamily(
    name="mistral",
    architectures=("MistralForCausalLM",),
    model_types=("mistral",),
    order=3,
    max_position_embeddings=131072,
    sliding_window=sliding_window,
    config_keys=config_keys,
    tiny=(TinyRecipe("mistral", tiny, add_bos=True),),
)
