"""PEFT adapter directories in and out: ``adapter_config.json`` + ``adapter_model.safetensors``.

A rank's adapters (``LoRAAdapters``) hold each projection's ``A`` and ``B`` as tensor-parallel
shards; PEFT holds the whole matrices under the Hugging Face module that computes the projection:

    base_model.model.model.layers.<i>.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight
    base_model.model.model.layers.<i>.mlp.{gate,up,down}_proj.lora_{A,B}.weight

``gather_adapter_tensors`` assembles the whole matrices (collective over tensor parallelism: the
``B`` rows of column-parallel layers, the ``A`` columns of row-parallel ones), in float32;
``write_adapter_directory`` writes them with PEFT's config (``r``, ``lora_alpha``,
``target_modules``, no dropout, no bias). ``load_adapter_directory`` reads a directory back into
a model's adapters, each rank taking its shard: an adapter trained here, or with PEFT on the
Hugging Face model (same rank and targets), continues training. Names and shapes are checked;
a missing, unexpected or misshapen tensor raises ``AdapterLoadError`` naming the file and the
tensor. The Hugging Face row order of a projection is the order of its rows on the ranks
(``adapter.py``), so no permutation is needed, only concatenation and slicing.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from megatron.rl.lora.adapter import LinearAdapter
from megatron.rl.lora.config import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LoRAConfig,
    read_adapter_config,
)
from megatron.rl.lora.model import LoRAAdapters

PEFT_PREFIX = "base_model.model."
"""What PEFT's ``PeftModel`` puts before the Hugging Face model's own module names."""
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


class AdapterLoadError(ValueError):
    """An adapter directory whose tensors do not fit the model's adapters (names the file)."""


def peft_key(layer: int, projection: str, matrix: str) -> str:
    """PEFT's name of ``matrix`` ("A" or "B") of ``projection`` in layer ``layer``."""
    block = "self_attn" if projection in ATTENTION else "mlp"
    return f"{PEFT_PREFIX}model.layers.{layer}.{block}.{projection}.lora_{matrix}.weight"


def _gather(tensor: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``tensor``'s shards of every rank of ``group`` concatenated along ``dim`` (float32)."""
    tensor = tensor.detach().float().contiguous()
    size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    if size == 1:
        return tensor.cpu().clone()
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat([p.cpu() for p in parts], dim=dim)


def gather_adapter_tensors(adapters: LoRAAdapters) -> dict[str, torch.Tensor]:
    """Every adapter's whole ``A`` and ``B`` per projection under PEFT's names, float32 on the
    CPU (collective over each adapter's tensor-parallel group; one pipeline stage)."""
    out: dict[str, torch.Tensor] = {}
    for layer, _, adapter in adapters.adapters():
        column = adapter.layout.column
        for projection in adapter.targets:
            a, b = adapter.a_of(projection), adapter.lora_B[projection]
            a = a.detach().float().cpu().clone() if column else _gather(a, 1, adapter.tp_group)
            b = _gather(b, 0, adapter.tp_group) if column else b.detach().float().cpu().clone()
            out[peft_key(layer, projection, "A")] = a
            out[peft_key(layer, projection, "B")] = b
    return out


def write_adapter_directory(
    directory: str | Path,
    tensors: dict[str, torch.Tensor],
    config: LoRAConfig,
    base_model: str | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``tensors`` (``gather_adapter_tensors``) and PEFT's config of ``config`` into
    ``directory``; ``dtype``: cast the tensors (default float32). Returns the directory."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": 0.0,
        "target_modules": list(config.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": config.rslora,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "base_model_name_or_path": base_model,
    }
    (out / ADAPTER_CONFIG).write_text(
        json.dumps(adapter_config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    cast = {k: (v.to(dtype) if dtype is not None else v).contiguous() for k, v in tensors.items()}
    save_file(cast, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return out


def read_adapter_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of ``directory/adapter_model.safetensors`` (``AdapterLoadError`` when it is
    missing or unreadable)."""
    from safetensors.torch import load_file

    path = Path(directory) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise AdapterLoadError(f"{directory}: no {ADAPTER_WEIGHTS}")
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise AdapterLoadError(f"{path}: not a readable safetensors file ({exc})") from None


def load_adapter_directory(adapters: LoRAAdapters, directory: str | Path) -> None:
    """Copy the adapter directory's matrices into ``adapters`` (each rank its shard).

    The directory's rank and targets must be the adapters' (``adapters.config``; alpha is the
    caller's to take from ``adapter_config.json``); every tensor must be present with its whole
    shape, and none left over."""
    saved = read_adapter_config(directory)
    config = adapters.config
    where = Path(directory) / ADAPTER_WEIGHTS
    if saved.rank != config.rank or saved.targets != config.targets:
        raise AdapterLoadError(
            f"{directory}: rank {saved.rank} targets {list(saved.targets)} do not match the "
            f"model's adapters (rank {config.rank}, targets {list(config.targets)})"
        )
    tensors = read_adapter_tensors(directory)
    used: set[str] = set()
    with torch.no_grad():
        for layer, _, adapter in adapters.adapters():
            for projection in adapter.targets:
                a = _read(tensors, where, peft_key(layer, projection, "A"), used)
                b = _read(tensors, where, peft_key(layer, projection, "B"), used)
                _copy_shards(adapter, projection, a, b, where, layer)
    left = sorted(set(tensors) - used)
    if left:
        raise AdapterLoadError(
            f"{where}: {len(left)} tensors fit no adapter of this model, e.g. {left[0]!r} (a "
            "model with fewer layers, or other targets)"
        )


def _read(tensors: dict, where: Path, key: str, used: set[str]) -> torch.Tensor:
    if key not in tensors:
        raise AdapterLoadError(f"{where}: missing tensor {key!r}")
    used.add(key)
    return tensors[key]


def _copy_shards(
    adapter: LinearAdapter, projection: str, a: torch.Tensor, b: torch.Tensor, where, layer: int
) -> None:
    """This rank's shards of the whole ``a`` (rank, in) and ``b`` (rows, rank) into ``adapter``."""
    layout, rank = adapter.layout, adapter.rank
    rows = layout.rows(projection) * (layout.tp_size if layout.column else 1)
    expected = {"A": (rank, layout.full_in_features), "B": (rows, rank)}
    for name, tensor in (("A", a), ("B", b)):
        if tuple(tensor.shape) != expected[name]:
            raise AdapterLoadError(
                f"{where}: {peft_key(layer, projection, name)} has shape {list(tensor.shape)}, "
                f"the model's adapter needs {list(expected[name])}"
            )
    t = layout.tp_rank
    if layout.column:
        local = layout.rows(projection)
        b = b[t * local : (t + 1) * local]
    else:
        width = layout.in_features
        a = a[:, t * width : (t + 1) * width]
    adapter.a_of(projection).copy_(a)
    adapter.lora_B[projection].copy_(b)
