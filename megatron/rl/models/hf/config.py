"""Hugging Face ``config.json`` <-> ``GPTArchitecture`` for Llama, Qwen2, Qwen3 and Mistral.

Supported ``architectures`` entries and what they map to (transformers 5.23 semantics; keys a
``config.json`` omits take the defaults of transformers' config classes):

* every family: RoPE (``rope_theta``; ``rope_scaling``/``rope_parameters`` of ``rope_type``
  ``default`` or ``llama3``), RMSNorm (``rms_norm_eps``), SwiGLU (``hidden_act: silu``),
  ``num_key_value_heads`` -> ``num_query_groups``, ``head_dim`` -> ``kv_channels``,
  ``tie_word_embeddings`` -> not ``untie_embeddings_and_output_weights``;
* ``LlamaForCausalLM`` (Llama 2, Llama 3.x): ``attention_bias`` and ``mlp_bias`` both true ->
  ``add_bias_linear`` (only one of them cannot be expressed in megatron-core and is refused);
* ``Qwen2ForCausalLM``: bias on q/k/v only -> ``add_qkv_bias``;
* ``Qwen3ForCausalLM``: per-head RMSNorm of q and k -> ``qk_layernorm``; ``head_dim`` may differ
  from ``hidden_size / num_attention_heads`` (default 128);
* ``MistralForCausalLM``: a ``sliding_window`` (default 4096) is refused when it is smaller
  than ``max_position_embeddings`` (it would mask keys that full attention sees); a window at
  least as long as ``max_position_embeddings`` never masks a key of a sequence the model
  supports, so it is accepted as full attention. Qwen's ``use_sliding_window`` likewise.

The embedding is padded to a multiple of ``make_vocab_size_divisible_by`` rows
(``GPTArchitecture.vocab_size``); ``HFModelConfig.vocab_size`` keeps the checkpoint's row count.
Anything else that would change the math (other RoPE types, partial rotary, other activations)
raises ``HFCheckpointError`` naming ``config.json`` and the field.

What differs between families (the list above) is each family's ``HFFamily`` entry
(``families/<family>.py``); this module reads and writes what they share and looks the rest up.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.rl.models.architecture import GPTArchitecture, RopeScaling
from megatron.rl.models.hf.errors import HFCheckpointError
from megatron.rl.models.hf.families import HFFamily, families, family_named, family_of

FAMILIES: dict[str, tuple[str, str]] = {
    family.name: (family.architectures[0], family.model_types[0]) for family in families()
}
"""family -> (``architectures`` entry, ``model_type``) written on export (``families()``)."""

_Fail = Callable[[str, str], HFCheckpointError]
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
_REQUIRED += ("num_attention_heads",)


@dataclass(frozen=True)
class HFModelConfig:
    """What ``config.json`` says, as this project needs it."""

    family: str
    """``llama``, ``qwen2``, ``qwen3`` or ``mistral`` (the ``name`` of its ``HFFamily``)."""
    arch: GPTArchitecture
    """The architecture, with the vocabulary padded for the embedding table."""
    vocab_size: int
    """Embedding rows in the checkpoint (``config.json`` ``vocab_size``), before padding."""
    dtype: str | None
    """``torch_dtype`` / ``dtype`` of the checkpoint's weights, if given."""
    bos_token_id: int | None
    eos_token_id: int | list[int] | None


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by``."""
    return -(-vocab_size // divisible_by) * divisible_by


def read_hf_config(directory: str | Path, make_vocab_size_divisible_by: int = 128) -> HFModelConfig:
    """Read ``directory/config.json`` into an ``HFModelConfig``; HFCheckpointError if unusable."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise HFCheckpointError(f"{path}: no config.json in the checkpoint directory {directory}")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise HFCheckpointError(f"{path}: cannot read config.json ({err})") from err
    return hf_model_config(cfg, str(path), make_vocab_size_divisible_by)


def hf_model_config(
    cfg: dict[str, Any], source: str = "config.json", make_vocab_size_divisible_by: int = 128
) -> HFModelConfig:
    """``HFModelConfig`` of a parsed ``config.json`` (``source`` names it in errors)."""

    def fail(field: str, message: str) -> HFCheckpointError:
        return HFCheckpointError(f"{source}: {field}: {message}")

    family = family_of(cfg, source)
    for key in _REQUIRED:
        if not isinstance(cfg.get(key), int):
            raise fail(key, f"missing or not an integer: {cfg.get(key)!r}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise fail("hidden_act", f"{cfg['hidden_act']!r} is not supported (only 'silu': SwiGLU)")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or family.head_dim or hidden // heads
    groups = cfg.get("num_key_value_heads") or heads
    if heads % groups:
        raise fail("num_key_value_heads", f"{groups} does not divide num_attention_heads={heads}")
    max_positions = cfg.get("max_position_embeddings") or family.max_position_embeddings
    _check_sliding_window(cfg, family, max_positions, fail)
    add_bias_linear, add_qkv_bias = _biases(cfg, family, fail)
    rotary_base, scaling = _rope(cfg, fail)
    moe = _experts(cfg, family, fail)
    vocab = cfg["vocab_size"]
    arch = GPTArchitecture(
        num_layers=cfg["num_hidden_layers"],
        hidden_size=hidden,
        num_attention_heads=heads,
        ffn_hidden_size=cfg["intermediate_size"],
        vocab_size=padded_vocab_size(vocab, make_vocab_size_divisible_by),
        max_position_embeddings=max_positions,
        num_query_groups=None if groups == heads else groups,
        kv_channels=None if head_dim * heads == hidden else head_dim,
        position_embedding_type="rope",
        rotary_base=rotary_base,
        rope_scaling=scaling,
        normalization="RMSNorm",
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        swiglu=True,
        add_bias_linear=add_bias_linear,
        add_qkv_bias=add_qkv_bias,
        qk_layernorm=family.qk_norm,
        untie_embeddings_and_output_weights=not cfg.get(
            "tie_word_embeddings", family.tie_word_embeddings
        ),
        **moe,
    )
    try:
        arch.validate()
    except ValueError as err:
        raise fail("architecture", str(err)) from err
    return HFModelConfig(
        family=family.name,
        arch=arch,
        vocab_size=vocab,
        dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
    )


def _experts(cfg: dict, family: HFFamily, fail: _Fail) -> dict[str, Any]:
    """The ``GPTArchitecture`` MoE fields of a mixture-of-experts family's ``config.json``."""
    names = family.moe
    if names is None:
        return {}
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not isinstance(experts, int) or experts < 1:
        raise fail("num_experts", f"missing or not a positive integer: {experts!r}")
    topk, width = cfg.get("num_experts_per_tok", 2), cfg.get(names.expert_width_key)
    for key, value in (("num_experts_per_tok", topk), (names.expert_width_key, width)):
        if not isinstance(value, int) or value < 1:
            raise fail(key, f"missing or not a positive integer: {value!r}")
    try:
        settings = names.settings(cfg)
    except ValueError as err:
        key = str(err).split("=", 1)[0]
        raise fail(key, str(err)) from None
    return dict(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=width, **settings)


def _check_sliding_window(cfg: dict, family: HFFamily, max_positions: int, fail: _Fail) -> None:
    window, sliding = family.sliding_window(cfg)
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        sliding = "sliding_attention" in layer_types
    if window is not None and sliding and window < max_positions:
        raise fail(
            "sliding_window",
            f"{window} < max_position_embeddings={max_positions}: sliding-window attention is not "
            "supported (only windows at least max_position_embeddings long, which never mask)",
        )


def _biases(cfg: dict, family: HFFamily, fail: _Fail) -> tuple[bool, bool]:
    """(add_bias_linear, add_qkv_bias) of the family's bias settings."""
    if family.qkv_bias:
        return False, True
    attention_bias = bool(cfg.get("attention_bias", False))
    mlp_bias = bool(cfg.get("mlp_bias", False)) if family.bias_linear else False
    if attention_bias != mlp_bias:
        raise fail(
            "attention_bias",
            f"attention_bias={attention_bias} with mlp_bias={mlp_bias}: megatron-core's "
            "add_bias_linear puts biases on the attention and the MLP projections together",
        )
    return attention_bias, False


def _rope(cfg: dict, fail: _Fail) -> tuple[float, RopeScaling | None]:
    """(rotary_base, Llama-3 scaling) of ``rope_parameters`` or ``rope_theta``+``rope_scaling``."""
    params = cfg.get("rope_parameters")
    field = "rope_parameters"
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        field = "rope_scaling"
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if not isinstance(params, dict) or "full_attention" in params:
        raise fail(field, f"per-layer-type RoPE parameters are not supported: {params!r}")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise fail("partial_rotary_factor", f"{partial} is not supported (only 1.0)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    base = float(params["rope_theta"])
    if rope_type == "default":
        return base, None
    if rope_type != "llama3":
        raise fail(f"{field}.rope_type", f"{rope_type!r} is not supported ('default', 'llama3')")
    try:
        scaling = RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    except KeyError as err:
        raise fail(field, f"rope_type 'llama3' needs {err.args[0]!r}") from None
    return base, scaling


def exportable(arch: GPTArchitecture) -> str | None:
    """Why ``arch`` cannot be written as a Hugging Face model of the family it would be exported
    as (``export_family_of``), or None when it can."""
    from megatron.rl.models.hf.families import export_family_of

    try:
        check_family(arch, export_family_of(arch).name)
    except ValueError as err:
        return str(err)
    return None


def check_family(arch: GPTArchitecture, family: str) -> None:
    """Raise ValueError naming the field if ``arch`` is not a model of the HF ``family``."""
    entry = family_named(family)
    wanted = dict(
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        rotary_percent=1.0,
        qk_layernorm=entry.qk_norm,
        add_qkv_bias=entry.qkv_bias,
    )
    if not entry.bias_linear:
        wanted.update(add_bias_linear=False)
    if entry.moe is None and arch.num_experts is not None:
        raise ValueError(
            f"GPTArchitecture.num_experts={arch.num_experts} cannot be exported as "
            f"{entry.architectures[0]} (a dense model; needs None)"
        )
    if entry.moe is not None:
        if arch.num_experts is None:
            raise ValueError(
                f"GPTArchitecture.num_experts=None cannot be exported as {entry.architectures[0]} "
                "(a mixture of experts)"
            )
        wanted.update(moe_shared_expert_intermediate_size=None)
        if arch.moe_router_pre_softmax not in entry.moe.pre_softmax:
            wanted.update(moe_router_pre_softmax=entry.moe.pre_softmax[0])
    for field, value in wanted.items():
        if getattr(arch, field) != value:
            raise ValueError(
                f"GPTArchitecture.{field}={getattr(arch, field)!r} cannot be exported as "
                f"{entry.architectures[0]} (needs {value!r})"
            )


def hf_config_dict(
    arch: GPTArchitecture,
    family: str,
    vocab_size: int,
    dtype: str = "float32",
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
) -> dict[str, Any]:
    """The ``config.json`` of ``arch`` as an HF ``family`` model with ``vocab_size`` rows.

    RoPE settings are written as ``rope_theta`` and ``rope_scaling`` (the layout of published
    Llama 3 configs, read by transformers 4 and 5).
    """
    check_family(arch, family)
    entry = family_named(family)
    scaling = arch.rope_scaling
    cfg: dict[str, Any] = {
        "architectures": [entry.architectures[0]],
        "model_type": entry.model_types[0],
        "vocab_size": vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.ffn_hidden_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.query_groups,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": arch.max_position_embeddings,
        "rms_norm_eps": arch.norm_epsilon,
        "rope_theta": float(arch.rotary_base),
        "rope_scaling": (
            None
            if scaling is None
            else {
                "rope_type": "llama3",
                "factor": scaling.factor,
                "low_freq_factor": scaling.low_freq_factor,
                "high_freq_factor": scaling.high_freq_factor,
                "original_max_position_embeddings": scaling.original_max_position_embeddings,
            }
        ),
        "tie_word_embeddings": not arch.untie_embeddings_and_output_weights,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
    }
    cfg.update(entry.config_keys(arch))
    return cfg
