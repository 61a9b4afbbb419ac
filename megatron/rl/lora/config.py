"""What a LoRA run adapts, and PEFT's ``adapter_config.json``; no torch (the flags import it).

An adapter is a low-rank pair per *projection*: ``delta(x) = (alpha / rank) * B @ A @ x`` with
``A`` (rank, in) and ``B`` (out, rank). megatron-core fuses projections into one linear layer, so a
layer's adapter holds one pair per projection it computes, as PEFT holds one per Hugging Face
module:

    megatron-core module   projections (Hugging Face names)
    linear_qkv             q_proj, k_proj, v_proj
    linear_proj            o_proj
    linear_fc1             gate_proj, up_proj (SwiGLU; up_proj alone for a plain MLP)
    linear_fc2             down_proj

``--lora-target-modules`` takes either spelling (and PEFT's ``all-linear``); a module name
stands for all of its projections. A rank-r run therefore has exactly the parameters of PEFT's
``LoraConfig(r=r, target_modules=[...])`` on the Hugging Face model, and an adapter directory maps
one to one in both directions.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

MODULE_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
"""megatron-core's linear layers of a transformer layer -> the projections each computes, in the
order of its output rows (of one tensor-parallel rank)."""

PROJECTIONS: tuple[str, ...] = tuple(p for ps in MODULE_PROJECTIONS.values() for p in ps)
"""Every projection, in layer order."""

MODULE_OF: dict[str, str] = {p: m for m, ps in MODULE_PROJECTIONS.items() for p in ps}
"""Projection -> the megatron-core module that computes it."""

ALL_LINEAR = "all-linear"
"""PEFT's name for every linear layer of the transformer blocks (not the output layer)."""

TARGET_NAMES: tuple[str, ...] = (*MODULE_PROJECTIONS, *PROJECTIONS, ALL_LINEAR)
"""Every name ``--lora-target-modules`` accepts."""

DEFAULT_TARGETS: tuple[str, ...] = tuple(MODULE_PROJECTIONS)
"""All four modules, as Megatron-Bridge and NeMo-RL default to."""

INITS: tuple[str, ...] = ("kaiming", "gaussian")
"""How ``A`` starts (``B`` always starts at zero, so step 0 is the base model exactly):
``kaiming``: uniform in +-1/sqrt(in_features) (PEFT's default, ``init_lora_weights=True``);
``gaussian``: normal with standard deviation 1/rank (PEFT's ``"gaussian"``)."""

DEFAULT_ALPHA = 32.0
"""The default alpha, the same at every rank: with the scale alpha / rank and A initialized
independently of the rank, AdamW's first updates move the policy alike at every rank
(``tools/benchmarks/lora_rank_probe.py``), so a learning rate found at one rank serves the
others."""

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def target_projections(names: Iterable[str], gated: bool = True) -> tuple[str, ...]:
    """The projections that ``names`` (module names, projection names, ``all-linear``) target,
    in layer order; ``ValueError`` naming an unknown name, an empty list, or ``gate_proj`` for a
    model whose MLP has no gate (``gated=False``: ``linear_fc1`` is ``up_proj`` alone)."""
    wanted: set[str] = set()
    names = list(names)
    if not names:
        raise ValueError("no target modules given")
    for name in names:
        if name == ALL_LINEAR:
            wanted.update(PROJECTIONS)
        elif name in MODULE_PROJECTIONS:
            wanted.update(MODULE_PROJECTIONS[name])
        elif name == "gate_proj" and not gated:
            raise ValueError("gate_proj: this model's MLP has no gate (not SwiGLU)")
        elif name in MODULE_OF:
            wanted.add(name)
        else:
            raise ValueError(f"unknown target module {name!r} (known: {', '.join(TARGET_NAMES)})")
    if not gated:
        wanted.discard("gate_proj")
    return tuple(p for p in PROJECTIONS if p in wanted)


def target_modules(projections: Iterable[str]) -> tuple[str, ...]:
    """The megatron-core modules that compute ``projections``, in layer order."""
    wanted = {MODULE_OF[p] for p in projections}
    return tuple(m for m in MODULE_PROJECTIONS if m in wanted)


@dataclass(frozen=True)
class LoRAConfig:
    """The adapters of a model: rank, scale, targets, initialization."""

    rank: int
    """Rows of each ``A`` (columns of each ``B``)."""
    alpha: float
    """The adapter's output is scaled by ``alpha / rank`` (``alpha / sqrt(rank)`` with
    ``rslora``)."""
    targets: tuple[str, ...] = PROJECTIONS
    """Projections that get an adapter (``target_projections``), in layer order."""
    init: str = "kaiming"
    """How ``A`` starts (``INITS``); ``B`` starts at zero."""
    rslora: bool = False
    """Rank-stabilized scaling: ``alpha / sqrt(rank)`` (PEFT's ``use_rslora``)."""
    seed: int = 1234
    """Seed of ``A``'s initial values: each projection of each layer draws from its own generator
    seeded from (seed, layer, projection), so the initial adapter is the same at every
    tensor-parallel layout and draws nothing from the run's random streams."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if self.init not in INITS:
            raise ValueError(f"LoRA init must be one of {INITS}, got {self.init!r}")
        unknown = [t for t in self.targets if t not in MODULE_OF]
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets must be projections of {PROJECTIONS}, got {unknown}")

    @property
    def scale(self) -> float:
        """The factor of the adapter's output: ``alpha / rank``, or ``alpha / sqrt(rank)``."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


@dataclass(frozen=True)
class AdapterDirectory:
    """What a PEFT adapter directory's ``adapter_config.json`` says (the parts we use)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    """Projections, in layer order."""
    base_model: str | None
    """``base_model_name_or_path``: what it was trained on (informational)."""
    rslora: bool = False
    """``use_rslora``: the scale is ``alpha / sqrt(r)``."""


class AdapterConfigError(ValueError):
    """An adapter directory we cannot read or do not support (the message names the file)."""


def read_adapter_config(directory: str | Path) -> AdapterDirectory:
    """Read ``directory/adapter_config.json`` (PEFT's LoRA format); ``AdapterConfigError`` names
    the file and the field for anything unreadable or unsupported (DoRA, per-module ranks,
    layer subsets, bias training, modules saved whole)."""
    path = Path(directory) / ADAPTER_CONFIG
    if not path.is_file():
        raise AdapterConfigError(f"{directory}: no {ADAPTER_CONFIG} (not a PEFT adapter directory)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise AdapterConfigError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise AdapterConfigError(f"{path}: expected a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterConfigError(f"{path}: peft_type {raw.get('peft_type')!r} is not LORA")
    unsupported = {
        "use_dora": (False, None),
        "fan_in_fan_out": (False, None),
        "bias": ("none", None),
        "modules_to_save": (None,),
        "layers_to_transform": (None,),
        "rank_pattern": ({}, None),
        "alpha_pattern": ({}, None),
        "lora_bias": (False, None),
        "target_parameters": (None,),
        "exclude_modules": (None,),
        "layer_replication": (None,),
    }
    for field, allowed in unsupported.items():
        if raw.get(field) not in allowed:
            raise AdapterConfigError(f"{path}: {field}={raw[field]!r} is not supported")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise AdapterConfigError(f"{path}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)):
        raise AdapterConfigError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    dropout = raw.get("lora_dropout", 0.0) or 0.0
    if not isinstance(dropout, (int, float)):
        raise AdapterConfigError(f"{path}: lora_dropout must be a number, got {dropout!r}")
    modules = raw.get("target_modules")
    if isinstance(modules, str):
        if modules != ALL_LINEAR:
            raise AdapterConfigError(
                f"{path}: target_modules as a pattern ({modules!r}) is not supported: list the "
                "module names"
            )
        modules = [modules]
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise AdapterConfigError(f"{path}: target_modules must be a list of names")
    try:
        targets = target_projections(modules)
    except ValueError as exc:
        raise AdapterConfigError(f"{path}: target_modules: {exc}") from None
    rslora = raw.get("use_rslora") or False
    if not isinstance(rslora, bool):
        raise AdapterConfigError(f"{path}: use_rslora must be true or false, got {rslora!r}")
    base = raw.get("base_model_name_or_path")
    base = base if isinstance(base, str) else None
    return AdapterDirectory(rank, float(alpha), targets, base, rslora)
