"""Hugging Face model families, one module each: ``llama.py``, ``mistral.py``, ``mixtral.py``,
``qwen2.py``, ``qwen3.py`` and ``qwen3_moe.py``.

A family is a module of this package, named as the family, that defines ``FAMILY =
HFFamily(...)`` (``base.py``); ``families()`` finds every one. ``config.py`` (``config.json`` <->
``GPTArchitecture``), ``tiny.py`` (tiny test models), ``gguf.py`` and the trainer's exporter look
families up here: adding a family means adding its module, nothing else (its tiny recipes join
the parity tests by themselves).

* ``families()``: every entry, in ``order``;
* ``family_of(model_type)`` / ``family_of(config_dict)``: the family claiming a ``model_type``, or
  a parsed ``config.json``'s one ``architectures`` entry; ``HFCheckpointError`` naming the
  supported ones otherwise;
* ``family_named(name)``: by the family's name (``HFModelConfig.family``);
* ``export_family_of(arch)``: the family an architecture without a checkpoint is exported as.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from megatron.rl.models.hf.errors import HFCheckpointError
from megatron.rl.models.hf.families.base import HFFamily, TinyRecipe

if TYPE_CHECKING:
    from megatron.rl.models.architecture import GPTArchitecture

_NOT_FAMILIES = ("base",)
"""Modules of this package that are not families."""


def families() -> tuple[HFFamily, ...]:
    """Every family module's ``FAMILY``, ordered by ``order``; the modules are checked: one entry
    each, named as the module, and no name, ``order`` or tiny recipe claimed twice."""
    found = []
    for module in pkgutil.iter_modules(__path__):
        if module.name in _NOT_FAMILIES or module.name.startswith("_"):
            continue
        entry = getattr(importlib.import_module(f"{__name__}.{module.name}"), "FAMILY", None)
        if not isinstance(entry, HFFamily) or entry.name != module.name:
            raise TypeError(
                f"{__name__}.{module.name} must define FAMILY = HFFamily(name={module.name!r}, "
                f"...), found {entry!r}"
            )
        found.append(entry)
    found.sort(key=lambda family: family.order)
    _check_distinct(found)
    return tuple(found)


def _check_distinct(found: list[HFFamily]) -> None:
    """TypeError if two families claim the same order, name or recipe, or not one is the
    export default."""
    claims = {
        "order": [f.order for f in found],
        "architectures entry": [a for f in found for a in f.architectures],
        "model_type": [t for f in found for t in f.model_types],
        "tiny recipe": [r.name for f in found for r in f.tiny],
    }
    for what, values in claims.items():
        twice = sorted({v for v in values if values.count(v) > 1})
        if twice:
            raise TypeError(f"Hugging Face families claim the same {what} twice: {twice}")
    defaults = [f.name for f in found if f.export_default]
    if len(defaults) != 1:
        raise TypeError(f"exactly one family must be the export default, found {defaults}")


def family_named(name: str) -> HFFamily:
    """The family called ``name``; ValueError naming the known ones otherwise."""
    known = {family.name: family for family in families()}
    if name not in known:
        raise ValueError(f"family {name!r} is not one of {sorted(known)}")
    return known[name]


def family_of(
    model_type_or_config: str | Mapping[str, Any], source: str = "config.json"
) -> HFFamily:
    """The family of a ``model_type`` string, or of a parsed ``config.json`` by its one
    ``architectures`` entry (``source`` names the file in errors).

    HFCheckpointError naming the supported ``model_type`` values or ``architectures`` entries if
    no family claims it.
    """
    known = families()
    if isinstance(model_type_or_config, str):
        for family in known:
            if model_type_or_config in family.model_types:
                return family
        supported = ", ".join(t for family in known for t in family.model_types)
        raise HFCheckpointError(
            f"model_type {model_type_or_config!r} is not supported (supported: {supported})"
        )
    entries = model_type_or_config.get("architectures")
    supported = ", ".join(a for family in known for a in family.architectures)
    if not isinstance(entries, list) or len(entries) != 1:
        raise HFCheckpointError(
            f"{source}: architectures: expected one entry, got {entries!r} (supported: {supported})"
        )
    for family in known:
        if entries[0] in family.architectures:
            return family
    raise HFCheckpointError(
        f"{source}: architectures: {entries[0]!r} is not supported (supported: {supported})"
    )


def export_family_of(arch: GPTArchitecture) -> HFFamily:
    """The family an architecture is exported as when no checkpoint was loaded: the one whose
    ``exported_for`` accepts it (Qwen3: QK norm; Qwen2: QKV bias only), else the export default
    (Llama)."""
    known = families()
    accepting = [f for f in known if f.exported_for is not None and f.exported_for(arch)]
    if len(accepting) > 1:
        raise TypeError(f"families {[f.name for f in accepting]} all claim to export {arch}")
    if accepting:
        return accepting[0]
    return next(family for family in known if family.export_default)


__all__ = [
    "HFFamily",
    "TinyRecipe",
    "export_family_of",
    "families",
    "family_named",
    "family_of",
]
