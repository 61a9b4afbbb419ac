"""LoRA on a megatron-core ``GPTModel``, in place: the base frozen, adapters beside its layers.

``apply_lora(model, config)`` freezes every parameter of the model, builds a ``LinearAdapter``
for each targeted linear layer of each transformer layer (``linear_qkv``, ``linear_proj``, and a
dense MLP's ``linear_fc1``, ``linear_fc2``; with the Transformer Engine layer spec the same names,
norms fused), keeps them in a ``LoRAAdapters`` module registered on the model as ``lora`` (state
dict keys ``lora.layers.<layer>.<module>.lora_A`` and ``.lora_B.<projection>``, ``<layer>`` the
global 0-based layer number, so the keys do not depend on the pipeline layout), and adds each
adapter's output to its layer's with a forward hook. Every forward of the model's modules, in
training, in the reference pass, in megatron-core's inference engines, therefore runs base +
adapter, and nothing is merged or copied: an optimizer step on the adapters is seen by the next
forward. The CPU engine's plain-torch forward (``megatron/rl/inference/cpu/cached_forward.py``)
reads the same adapters through ``LoRAAdapters.adapter_for``.

``adapters_disabled(model)`` switches every adapter off for the duration of a block: the base
model, which is the reference policy of the KL term (no second copy of the weights).

Mixture-of-experts MLPs get no adapters (``apply_lora`` refuses MLP targets on them); their
attention layers do.
"""

from __future__ import annotations

import contextlib
import hashlib
import weakref
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from megatron.core.utils import unwrap_model

from megatron.rl.lora.adapter import LinearAdapter, fused_input_norm, layout_of
from megatron.rl.lora.config import MODULE_OF, MODULE_PROJECTIONS, LoRAConfig

PREFIX = "lora."
"""State dict keys of the adapters start with it."""


class LoRAAdapters(torch.nn.Module):
    """A model's adapters: ``layers[str(layer)][module]`` is the ``LinearAdapter`` of that linear
    layer; ``active`` switches all of them (``adapters_disabled``).

    A server may hold further named sets beside them (``named``, ``add_named_adapters``, not in
    the state dict) and pick one for a forward (``selected``); ``adapter_for`` answers with the
    selected set's adapter."""

    def __init__(self, config: LoRAConfig | None) -> None:
        super().__init__()
        self.config = config
        """The trained set's (None: a served model whose base answers without one)."""
        self.layers = torch.nn.ModuleDict()
        self.active = True
        """Whether the hooks (and the CPU engine) add the adapters' outputs."""
        self._of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.module_names: dict[tuple[int, str], str] = {}
        """(layer, module) -> the adapted layer's name in the model (its weight's state-dict key
        without ``.weight``)."""
        self.named: dict[str, LoRAAdapters] = {}
        """Further adapter sets by name (a multi-adapter server's), on the same layers."""
        self.selected: str | None = None
        """The named set forwards use (None: this set)."""

    def add(self, layer: int, name: str, module: torch.nn.Module, adapter: LinearAdapter) -> None:
        """Register ``adapter`` as the adapter of ``module`` (layer ``layer``'s ``name``)."""
        key = str(layer)
        if key not in self.layers:
            self.layers[key] = torch.nn.ModuleDict()
        self.layers[key][name] = adapter
        self._of[module] = adapter

    def adapter_for(self, module: torch.nn.Module) -> LinearAdapter | None:
        """The adapter a forward adds to a linear layer of the model now: the selected set's,
        None while the adapters are off or where the set has none."""
        if not self.active:
            return None
        chosen = self if self.selected is None else self.named[self.selected]
        return chosen._of.get(module)

    def output_dtype(self, module: torch.nn.Module) -> torch.dtype | None:
        """The dtype ``module``'s output is returned in while this set's own adapter of it is
        off (the reference, the base): its adapter's (``LinearAdapter.added_to``), so the base
        computes what base + a zero adapter computes; None for a module without one."""
        own = self._of.get(module)
        return None if own is None else own.lora_A.dtype

    def adapters(self) -> Iterator[tuple[int, str, LinearAdapter]]:
        """(layer, module name, adapter) of every adapter, by layer and module order."""
        for key in sorted(self.layers, key=int):
            for name in MODULE_PROJECTIONS:
                if name in self.layers[key]:
                    yield int(key), name, self.layers[key][name]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> dict:
        """megatron-core ``dist_checkpointing`` tensors of the adapters: the tensor-parallel
        shards along their ``partition_dim``, the rest replicated (keys as ``state_dict``'s)."""
        from megatron.core.utils import (
            make_sharded_tensor_for_checkpoint,
            make_tp_sharded_tensor_for_checkpoint,
        )

        out = {}
        for name, param in self.named_parameters():
            key = f"{prefix}{name}"
            if getattr(param, "tensor_model_parallel", False):
                out[key] = make_tp_sharded_tensor_for_checkpoint(
                    param, key, tp_axis=param.partition_dim
                )
            else:
                out[key] = make_sharded_tensor_for_checkpoint(param, key)
        return out


def _linear_layers(layer: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """The adaptable linear layers of a transformer layer: (megatron-core name, module)."""
    attention, mlp = getattr(layer, "self_attention", None), getattr(layer, "mlp", None)
    for name in ("linear_qkv", "linear_proj"):
        if attention is not None and hasattr(attention, name):
            yield name, getattr(attention, name)
    for name in ("linear_fc1", "linear_fc2"):
        if mlp is not None and hasattr(mlp, name):  # a dense MLP (MoE layers have experts)
            yield name, getattr(mlp, name)


def _tp_of(module: torch.nn.Module) -> tuple[dist.ProcessGroup | None, int, int]:
    """The tensor-parallel group, rank and size of a megatron-core (or Transformer Engine)
    linear layer."""
    group = getattr(module, "tp_group", None)
    if group is None and dist.is_initialized():
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            group = parallel_state.get_tensor_model_parallel_group()
    if group is None or not dist.is_initialized():
        return None, 0, 1
    return group, dist.get_rank(group), dist.get_world_size(group)


def apply_lora(model: torch.nn.Module, config: LoRAConfig) -> LoRAAdapters:
    """Freeze ``model`` (a ``GPTModel``, possibly wrapped) and attach the adapters of ``config``
    to its targeted layers (see the module docstring); returns them (also ``model.lora``).

    Call it after the base weights are loaded and before DDP wraps the model. The adapters are
    float32 on the base's device; ``B`` starts at zero, so the model computes what it did.
    ``ValueError`` when a targeted module exists in no layer (an MoE model's MLP)."""
    gpt = unwrap_model(model)
    if isinstance(getattr(gpt, "lora", None), LoRAAdapters):
        raise ValueError("the model already has LoRA adapters")
    adapters = _install(gpt, LoRAAdapters(config))
    _build(gpt, adapters, config)
    return adapters


def add_named_adapters(model: torch.nn.Module, name: str, config: LoRAConfig) -> LoRAAdapters:
    """A further adapter set ``name`` on ``model``'s layers (a multi-adapter server's), beside
    its own (none: the base answers unadapted); forwards use it inside ``selected_adapters``.
    Freezes the model; returns the new set (``B`` zero until loaded)."""
    gpt = unwrap_model(model)
    adapters = lora_adapters(gpt) or _install(gpt, LoRAAdapters(None))
    if name in adapters.named:
        raise ValueError(f"adapter {name!r} is already on the model")
    adapters.named[name] = _build(gpt, LoRAAdapters(config), config)
    return adapters.named[name]


def _install(gpt: torch.nn.Module, adapters: LoRAAdapters) -> LoRAAdapters:
    """Freeze ``gpt``, hook every adaptable linear layer to add ``adapters.adapter_for`` it,
    and register ``adapters`` as ``gpt.lora``."""
    for param in gpt.parameters():
        param.requires_grad_(False)
    for layer in gpt.decoder.layers:
        for _, module in _linear_layers(layer):
            fused = hasattr(module, "layer_norm_weight")  # Transformer Engine's LayerNormLinear
            module.register_forward_hook(_output_hook(adapters, fused))
    gpt.lora = adapters
    return adapters


def _build(gpt: torch.nn.Module, adapters: LoRAAdapters, config: LoRAConfig) -> LoRAAdapters:
    """Fill ``adapters`` with ``config``'s adapters of ``gpt``'s targeted layers."""
    names = {id(m): n for n, m in gpt.named_modules()}
    found: set[str] = set()
    for layer in gpt.decoder.layers:
        index = layer.layer_number - 1  # megatron-core numbers layers from 1, over all stages
        for name, module in _linear_layers(layer):
            group, rank, size = _tp_of(module)
            layout = layout_of(name, module, rank, size)
            present = {p for p, _ in layout.projections}
            targets = tuple(p for p in config.targets if MODULE_OF[p] == name and p in present)
            if not targets:
                continue
            adapter = LinearAdapter(
                layout, targets, config.rank, config.scale, group, device=module.weight.device
            )
            adapter.reset(config, index)
            adapters.add(index, name, module, adapter)
            adapters.module_names[(index, name)] = names[id(module)]
            found.add(name)
    wanted = {MODULE_OF[p] for p in config.targets}
    if len(gpt.decoder.layers) and wanted - found:
        missing = sorted(wanted - found)
        raise ValueError(
            f"LoRA targets {missing} are in no layer of this model (a mixture-of-experts MLP "
            "has experts instead of linear_fc1/linear_fc2: target the attention, linear_qkv and "
            "linear_proj)"
        )
    return adapters


def _output_hook(adapters: LoRAAdapters, fused_norm: bool):
    """The forward hook adding the layer's current adapter's output (``adapter_for``) to its
    (output, bias); with a fused input norm the adapter reads the normalized input."""

    def hook(module, args, output):
        out, bias = output
        adapter = adapters.adapter_for(module)
        if adapter is None:
            dtype = adapters.output_dtype(module)
            return (out if dtype is None else out.to(dtype)), bias
        x = fused_input_norm(module, args[0]) if fused_norm else args[0]
        return adapter.added_to(out, x), bias

    return hook


def lora_adapters(model: torch.nn.Module) -> LoRAAdapters | None:
    """The adapters of ``model`` (wrapped or not), or None."""
    found = getattr(unwrap_model(model), "lora", None)
    return found if isinstance(found, LoRAAdapters) else None


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Run the base model in the block: every adapter of ``model`` off (nothing for a model
    without adapters)."""
    adapters = lora_adapters(model)
    if adapters is None:
        yield
        return
    previous, adapters.active = adapters.active, False
    try:
        yield
    finally:
        adapters.active = previous


@contextlib.contextmanager
def base_model(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` as its base in the block: the reference policy of a LoRA model, which is
    the trained model itself with every adapter off and, for a mixture of experts, its routers'
    replay off (the reference routes by its own choices, as a separate reference model does).
    Nothing changes for a model without adapters."""
    if lora_adapters(model) is None:
        yield
        return
    from megatron.rl.models.routing_replay import routing_replays

    replays = routing_replays(model)
    modes = [r.mode for r in replays]
    with adapters_disabled(model):
        for r in replays:
            r.mode = "off"
        try:
            yield
        finally:
            for r, mode in zip(replays, modes):
                r.mode = mode


@contextlib.contextmanager
def selected_adapters(model: torch.nn.Module, name: str | None) -> Iterator[None]:
    """Forwards of ``model`` in the block use the named adapter set ``name`` (None: the model's
    own set, which for a multi-adapter server is the base)."""
    adapters = lora_adapters(model)
    if adapters is None and name is None:
        yield
        return
    if adapters is None or (name is not None and name not in adapters.named):
        known = [] if adapters is None else sorted(adapters.named)
        raise KeyError(f"no LoRA adapter {name!r} on the model (adapters: {known})")
    previous, adapters.selected = adapters.selected, name
    try:
        yield
    finally:
        adapters.selected = previous


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key of the model is an adapter's."""
    return key.startswith(PREFIX)


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint of ``model`` must hold: the adapters' tensors when it has adapters, else
    the whole state dict."""
    state = unwrap_model(model).state_dict()
    if lora_adapters(model) is None:
        return state
    return {k: v for k, v in state.items() if is_adapter_key(k)}


def load_trainable_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load what ``trainable_state_dict`` returned; with adapters, exactly the adapters' keys
    (``ValueError`` naming missing or unexpected ones) and the base untouched."""
    gpt = unwrap_model(model)
    if lora_adapters(model) is None:
        gpt.load_state_dict(state)
        return
    expected = set(trainable_state_dict(model))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"the adapters do not fit this model: missing {missing[:4]}, unexpected "
            f"{unexpected[:4]} ({len(missing)} and {len(unexpected)})"
        )
    gpt.load_state_dict(state, strict=False)


class BaseMismatchError(ValueError):
    """An original base value given to ``merged_state_dict`` is not the base the adapters were
    trained on (it does not round to the stored base weight)."""


def merged_state_dict(
    model: torch.nn.Module, original: Mapping[str, Callable[[], torch.Tensor]] | None = None
) -> dict[str, torch.Tensor]:
    """This rank's base state dict with every adapter merged into its layer's weight; no adapter
    keys. The whole state dict for a model without adapters.

    The base is the stored one, or, where ``original`` (state-dict key -> reader of the value)
    names a key, the value it reads: the checkpoint's own values, of which the stored frozen
    base may be a bfloat16 rounding (``frozen.store_frozen_linear_weights``). ``BaseMismatchError`` if an
    original value does not round to the stored one exactly (another base than the one the
    adapters were trained on). A merged weight is ``W + scale * B @ A`` summed and returned in
    float32: the adapter's update is far smaller than the weight, and rounding the sum to a
    narrower dtype would drop most of it."""
    gpt = unwrap_model(model)
    state = {k: v for k, v in gpt.state_dict().items() if not is_adapter_key(k)}
    adapters = lora_adapters(model)
    if adapters is None:
        return state
    for key, read in (original or {}).items():
        stored, value = state[key], read().to(state[key].device)
        if value.shape != stored.shape or not torch.equal(value.to(stored.dtype), stored):
            raise BaseMismatchError(
                f"{key}: the original base values do not round to the stored base "
                f"({stored.dtype}): not the base the adapters were trained on"
            )
        state[key] = value
    for layer, name, adapter in adapters.adapters():
        key = adapters.module_names[(layer, name)] + ".weight"
        weight = state[key]
        state[key] = (weight.float() + adapter.delta_weight().to(weight.device)).contiguous()
    return state


def base_fingerprint(model: torch.nn.Module) -> str:
    """A short digest of this rank's frozen base weights (names, shapes, dtypes and 64 values of
    each): what a LoRA checkpoint records of the base its adapters were trained on."""
    digest = hashlib.sha256()
    for name, tensor in sorted(unwrap_model(model).state_dict().items()):
        if (
            is_adapter_key(name)
            or not isinstance(tensor, torch.Tensor)
            or name.endswith("_extra_state")
        ):
            continue
        flat = tensor.detach().reshape(-1)
        picks = flat[:: max(1, flat.numel() // 64)][:64].float().cpu()
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(picks.numpy().tobytes())
    return digest.hexdigest()[:16]
