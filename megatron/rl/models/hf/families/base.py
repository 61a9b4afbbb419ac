"""The entry of one Hugging Face model family (``HFFamily``) and of its tiny test models.

An entry says what a family's ``config.json`` means beyond the settings every supported family
shares (RoPE, RMSNorm, SwiGLU, grouped-query attention, read by ``config.py``): the names it
claims, transformers' defaults for the keys a ``config.json`` may omit, which optional tensors its
checkpoints hold (q/k/v bias, bias on every linear layer, q/k norm; ``mapping.py`` names them
from the ``GPTArchitecture`` flags the entry sets), the keys it writes on export, and the tiny
random models ``tiny.py`` builds of it for tests. Entries hold no transformers object: importing
one imports no Hugging Face package.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron.rl.models.architecture import GPTArchitecture


def full_attention(cfg: Mapping[str, Any]) -> tuple[int | None, bool]:
    """``(window, sliding)`` of a family whose layers attend to every key (Llama): ``window`` is
    ``config.json``'s ``sliding_window`` (used only if ``layer_types`` names sliding layers)."""
    return cfg.get("sliding_window"), False


def no_config_keys(arch: GPTArchitecture) -> dict[str, Any]:
    """No ``config.json`` key beyond the common ones."""
    return {}


@dataclass(frozen=True)
class TinyRecipe:
    """A tiny random model of a family, built by ``tiny.make_tiny_checkpoint(name, ...)``."""

    name: str
    """The recipe's name in ``tiny.TINY_FAMILIES`` (``llama3``); unique over all families."""
    settings: Callable[[dict[str, Any]], dict[str, Any]]
    """Given the common transformers config arguments (``tiny.tiny_config``: sizes, heads, token
    ids), the arguments this recipe sets or overrides."""
    add_bos: bool
    """Whether its tokenizer adds a BOS token (as Llama and Mistral tokenizers; Qwen's do not)."""


@dataclass(frozen=True)
class MoENames:
    """How a mixture-of-experts family names its experts and reads its router settings.

    Tensors of layer ``i``: ``model.layers.i.<block>.gate.weight`` (the router, (experts, hidden))
    and ``model.layers.i.<block>.experts.<j>.<gate|up|down>.weight`` per expert ``j``.
    """

    block: str
    """The MLP block's name: ``mlp`` (Qwen3-MoE) or ``block_sparse_moe`` (Mixtral)."""
    gate: str
    """An expert's gate projection (``gate_proj``; Mixtral ``w1``)."""
    up: str
    """An expert's up projection (``up_proj``; Mixtral ``w3``)."""
    down: str
    """An expert's down projection (``down_proj``; Mixtral ``w2``)."""
    expert_width_key: str
    """The ``config.json`` key of one expert's width (``moe_intermediate_size``; Mixtral
    ``intermediate_size``)."""
    pre_softmax: tuple[bool, ...]
    """The ``moe_router_pre_softmax`` values its routers can express."""
    settings: Callable[[Mapping[str, Any]], dict[str, Any]]
    """``config.json`` -> ``{"moe_router_pre_softmax": ...}``; raises ValueError naming the
    ``config.json`` key of a layout it does not support."""


@dataclass(frozen=True)
class HFFamily:
    """One Hugging Face model family: what ``config.py``, ``tiny.py`` and the exporter look up.

    A family is a module of ``megatron/rl/models/hf/families`` named ``name`` that defines
    ``FAMILY = HFFamily(...)``; ``families()`` finds every one.
    """

    name: str
    """The family's name: its module's name, ``HFModelConfig.family``, ``export_hf(family=)``."""
    architectures: tuple[str, ...]
    """``config.json`` ``architectures`` entries it reads; the first is written on export."""
    model_types: tuple[str, ...]
    """``config.json`` ``model_type`` values it claims; the first is written on export."""
    order: int
    """Its place in every listing (the supported names of errors, ``tiny.TINY_FAMILIES``, whose
    index seeds the tests' tiny checkpoints); unique."""
    max_position_embeddings: int
    """transformers' default ``max_position_embeddings`` (a ``config.json`` without the key)."""
    head_dim: int | None = None
    """transformers' default ``head_dim``; None: ``hidden_size / num_attention_heads``."""
    tie_word_embeddings: bool = False
    """transformers' default ``tie_word_embeddings`` (tied: the embedding is the output layer)."""
    qkv_bias: bool = False
    """q/k/v projections always have a bias and no other linear layer does (Qwen2): the
    ``*_proj.bias`` tensors of q, k, v, ``add_qkv_bias``; ``attention_bias`` is not read."""
    qk_norm: bool = False
    """Per-head RMSNorm of queries and keys (Qwen3): ``q_norm``/``k_norm`` tensors,
    ``qk_layernorm``."""
    bias_linear: bool = False
    """``config.json``'s ``attention_bias`` and ``mlp_bias`` are read (Llama): both true is
    ``add_bias_linear`` (a bias tensor on every projection). Without it the family's MLP has no
    bias, so ``attention_bias: true`` is refused (megatron-core cannot bias only the attention).
    """
    sliding_window: Callable[[Mapping[str, Any]], tuple[int | None, bool]] = full_attention
    """``(window, sliding)`` of a ``config.json``: the window length (None: none) and whether
    some layer uses it (``layer_types``, when given, decides instead). A window shorter than
    ``max_position_embeddings`` on a sliding layer is refused."""
    config_keys: Callable[[GPTArchitecture], dict[str, Any]] = no_config_keys
    """The family's ``config.json`` keys of an exported ``arch`` beyond the common ones."""
    exported_for: Callable[[GPTArchitecture], bool] | None = None
    """Whether an architecture that was not loaded from a checkpoint is exported as this family
    (at most one family accepts any architecture); None: never chosen that way."""
    export_default: bool = False
    """The family of an architecture no ``exported_for`` accepts (exactly one family: Llama)."""
    tiny: tuple[TinyRecipe, ...] = ()
    """Its tiny random test models (``tiny.py``), in ``TINY_FAMILIES`` order."""
    moe: MoENames | None = None
    """Mixture of experts in every layer (Qwen3-MoE, Mixtral); None: dense MLPs."""
