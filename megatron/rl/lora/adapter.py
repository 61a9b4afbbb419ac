"""The LoRA adapter of one tensor-parallel linear layer: one low-rank pair per projection.

For a projection p the adapter adds ``scale * B_p @ A_p @ x`` to the layer's output rows of p
(``A_p``: (rank, in), ``B_p``: (rows of p, rank), ``scale = alpha / rank``). A fused layer computes
several projections (QKV: q, k, v; SwiGLU's ``linear_fc1``: gate, up), so its adapter holds one
pair per targeted projection, and ``A`` is one parameter: the ``A_p`` of the targeted projections
stacked, (n x rank, in), so one matrix product feeds every projection.

Tensor parallelism shards an adapter the way the layer's weight is sharded:

* Column-parallel layers (``linear_qkv``, ``linear_fc1``) split their output rows: each rank holds
  its rows of every ``B_p`` (a contiguous block of the Hugging Face projection's rows: its query
  groups' heads, its slice of gate and of up) and the whole ``A`` (replicated). The product
  ``A @ x`` goes through megatron-core's ``copy_to_tensor_model_parallel_region`` (identity
  forward, all-reduce backward), so ``A``'s gradient, and the input's through the adapter, sum
  every rank's rows as the layer's own input gradient does.
* Row-parallel layers (``linear_proj``, ``linear_fc2``) split their input columns: each rank holds
  its columns of ``A`` and the whole ``B`` (replicated); ``A @ x`` is summed over the ranks with
  ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward), then ``B``
  makes the full output on every rank, as the layer's own (all-reduced) output is.

The sharded parameters carry megatron-core's tensor-parallel attributes (``partition_dim``), so
gradient norms count each shard once and ``dist_checkpointing`` stores the whole tensor.

The output rows of a fused layer follow megatron-core's layout
(``megatron/rl/models/hf/mapping.py``): QKV rows are grouped per query group g, ``[q heads of g, k of g, v of g]``; ``linear_fc1`` with a
gated unit is ``[gate; up]`` on each rank. ``delta`` computes each projection's rows in the
Hugging Face order and interleaves them into that layout.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

from megatron.rl.lora.config import MODULE_PROJECTIONS, LoRAConfig

COLUMN_PARALLEL = ("linear_qkv", "linear_fc1")
ROW_PARALLEL = ("linear_proj", "linear_fc2")

Transpose = Callable[[torch.Tensor], torch.Tensor]
"""weight (out, in) -> the (in, out) matrix a product ``x @ it`` uses (``w.t()``, or the CPU
engine's contiguous copy of it)."""


def _transpose(weight: torch.Tensor) -> torch.Tensor:
    return weight.t()


@dataclass(frozen=True)
class Layout:
    """Where one linear layer's projections sit, on this tensor-parallel rank."""

    module: str
    """megatron-core's name of the layer: ``linear_qkv``, ``linear_proj``, ``linear_fc1``,
    ``linear_fc2``."""
    projections: tuple[tuple[str, int], ...]
    """(projection, its output rows on this rank), in the layer's projection order."""
    in_features: int
    """Input width on this rank (a row-parallel layer's shard)."""
    tp_rank: int
    tp_size: int
    query_groups: int = 0
    """Query groups on this rank (``linear_qkv`` only): its rows are interleaved per group."""

    @property
    def column(self) -> bool:
        """Column-parallel (output rows split over TP) rather than row-parallel."""
        return self.module in COLUMN_PARALLEL

    @property
    def full_in_features(self) -> int:
        """Input width of the whole layer (a row-parallel layer's over every rank)."""
        return self.in_features * (1 if self.column else self.tp_size)

    @property
    def out_features(self) -> int:
        """Output rows on this rank."""
        return sum(rows for _, rows in self.projections)

    def rows(self, projection: str) -> int:
        """Output rows of ``projection`` on this rank."""
        return dict(self.projections)[projection]


def layout_of(module_name: str, module: torch.nn.Module, tp_rank: int, tp_size: int) -> Layout:
    """The layout of megatron-core's ``module_name`` layer ``module`` (its weight is this rank's
    (out, in) shard; its ``config`` is the model's ``TransformerConfig``)."""
    out_local, in_local = module.weight.shape
    c = module.config
    if module_name == "linear_qkv":
        heads, groups = c.num_attention_heads, c.num_query_groups or c.num_attention_heads
        d = c.kv_channels
        local_groups = groups // tp_size
        per_group = heads // groups
        projections = (
            ("q_proj", local_groups * per_group * d),
            ("k_proj", local_groups * d),
            ("v_proj", local_groups * d),
        )
        layout = Layout(module_name, projections, in_local, tp_rank, tp_size, local_groups)
    elif module_name == "linear_fc1" and c.gated_linear_unit:
        half = out_local // 2
        layout = Layout(
            module_name, (("gate_proj", half), ("up_proj", half)), in_local, tp_rank, tp_size
        )
    elif module_name == "linear_fc1":
        layout = Layout(module_name, (("up_proj", out_local),), in_local, tp_rank, tp_size)
    elif module_name in ROW_PARALLEL:
        (projection,) = MODULE_PROJECTIONS[module_name]
        layout = Layout(module_name, ((projection, out_local),), in_local, tp_rank, tp_size)
    else:
        raise ValueError(f"no LoRA layout for module {module_name!r}")
    if layout.out_features != out_local:
        raise ValueError(
            f"{module_name}: projections {layout.projections} do not add up to the weight's "
            f"{out_local} rows"
        )
    return layout


def initial_a(
    config: LoRAConfig, layer: int, projection: str, full_in_features: int
) -> torch.Tensor:
    """The initial (rank, full in) ``A`` of ``projection`` in layer ``layer`` (0-based, global):
    float32, from a generator of its own seeded by (seed, layer, projection), so every
    tensor-parallel layout starts from the same adapter and the run's RNG streams are untouched."""
    digest = hashlib.sha256(f"lora/{config.seed}/{layer}/{projection}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    a = torch.empty(config.rank, full_in_features, dtype=torch.float32)
    if config.init == "kaiming":  # PEFT's kaiming_uniform_(a=sqrt(5)): bound 1/sqrt(fan_in)
        bound = 1.0 / math.sqrt(full_in_features)
        return a.uniform_(-bound, bound, generator=generator)
    return a.normal_(0.0, 1.0 / config.rank, generator=generator)  # PEFT's "gaussian"


class LinearAdapter(torch.nn.Module):
    """LoRA of one linear layer (see the module docstring): ``lora_A`` (n x rank, in on this
    rank) and ``lora_B[p]`` (rows of p on this rank, rank) per targeted projection p."""

    def __init__(
        self,
        layout: Layout,
        targets: tuple[str, ...],
        rank: int,
        scale: float,
        tp_group: dist.ProcessGroup | None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        names = [p for p, _ in layout.projections]
        if not targets or any(t not in names for t in targets):
            raise ValueError(f"{layout.module}: targets {targets} are not among {names}")
        self.layout = layout
        self.targets = tuple(p for p in names if p in targets)  # the layer's order
        self.rank = rank
        self.scale = scale
        self.tp_group = tp_group
        n = len(self.targets)
        self.lora_A = torch.nn.Parameter(
            torch.zeros(n * rank, layout.in_features, dtype=dtype, device=device)
        )
        self.lora_B = torch.nn.ParameterDict(
            {
                p: torch.nn.Parameter(torch.zeros(layout.rows(p), rank, dtype=dtype, device=device))
                for p in self.targets
            }
        )
        if layout.tp_size > 1:  # each rank's shard counts once (norms, dist_checkpointing)
            if layout.column:
                for b in self.lora_B.values():
                    set_tensor_model_parallel_attributes(b, True, 0, 1)
            else:
                set_tensor_model_parallel_attributes(self.lora_A, True, 1, 1)

    def reset(self, config: LoRAConfig, layer: int) -> None:
        """``A`` as ``initial_a`` (this rank's columns of a row-parallel layer), ``B`` zero."""
        layout = self.layout
        with torch.no_grad():
            for i, projection in enumerate(self.targets):
                a = initial_a(config, layer, projection, layout.full_in_features)
                if not layout.column:
                    width = layout.in_features
                    a = a[:, layout.tp_rank * width : (layout.tp_rank + 1) * width]
                self.lora_A[i * self.rank : (i + 1) * self.rank].copy_(a)
            for b in self.lora_B.values():
                b.zero_()

    def a_of(self, projection: str) -> torch.Tensor:
        """``A`` of ``projection`` (rank, in on this rank): a view of ``lora_A``."""
        i = self.targets.index(projection)
        return self.lora_A[i * self.rank : (i + 1) * self.rank]

    def delta(self, x: torch.Tensor, transpose: Transpose = _transpose) -> torch.Tensor:
        """The adapter's addition to the layer's output on this rank: x (..., in) -> (..., out).

        ``transpose`` gives the (in, out) matrix of a weight for ``x @ it`` (the CPU engine passes
        its contiguous copies). Under autocast the products run in its dtype, as the layer's do.
        """
        a = torch.matmul(x, transpose(self.lora_A)) * self.scale  # (..., n * rank)
        if self.layout.tp_size > 1:
            if not self.layout.column:  # partial sums of the input shards
                a = reduce_from_tensor_model_parallel_region(a, group=self.tp_group)
            elif torch.is_grad_enabled():  # the backward sums every rank's rows' gradients
                a = copy_to_tensor_model_parallel_region(a, group=self.tp_group)
        r = self.rank
        parts = {
            p: torch.matmul(a[..., i * r : (i + 1) * r], transpose(self.lora_B[p]))
            for i, p in enumerate(self.targets)
        }  # projection -> (..., rows of p)
        return self._assemble(parts)

    def added_to(
        self, out: torch.Tensor, x: torch.Tensor, transpose: Transpose = _transpose
    ) -> torch.Tensor:
        """The layer's output ``out`` plus the adapter's ``delta(x)``, summed in the adapters'
        dtype (float32 on the CPU tier, whose products run in bfloat16 under ``--bf16``).

        A bfloat16 ``out`` is already a bfloat16 value, so a bfloat16 sum rounds every delta
        smaller than half a bfloat16 step of the output back to ``out``: the adapter's early,
        small updates would change nothing the forward computes (while their gradients still
        grow B), and the more so the higher the rank, whose updates are spread thinner. The
        float32 sum keeps them; where the adapters share the output's dtype (the CUDA tier's
        bfloat16 modules) nothing changes."""
        dtype = self.lora_A.dtype
        return out.to(dtype) + self.delta(x, transpose).to(dtype)

    def delta_weight(self) -> torch.Tensor:
        """The adapter as a weight of the layer's local shape, (out, in) on this rank:
        ``scale * B_p @ A_p`` in each projection's rows (float32; what merging adds)."""
        parts = {
            p: (self.lora_B[p].float() @ self.a_of(p).float()).t() * self.scale
            for p in self.targets
        }  # projection -> (in, rows of p)
        return self._assemble(parts).t()

    def _assemble(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """Projections' rows (..., rows of p) -> the layer's output layout (..., out), zeros for
        projections without an adapter."""
        layout = self.layout
        if len(layout.projections) == 1:
            return next(iter(parts.values()))
        sample = next(iter(parts.values()))
        lead = sample.shape[:-1]
        full = [
            parts[p] if p in parts else sample.new_zeros(*lead, rows)
            for p, rows in layout.projections
        ]
        if layout.query_groups:  # [q of g, k of g, v of g] per query group g
            g = layout.query_groups
            grouped = [t.reshape(*lead, g, t.shape[-1] // g) for t in full]
            return torch.cat(grouped, dim=-1).reshape(*lead, layout.out_features)
        return torch.cat(full, dim=-1)  # [gate; up]


def fused_input_norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The input norm that a Transformer Engine ``LayerNormLinear`` (megatron-core's
    ``TELayerNormColumnParallelLinear``) applies before its product: its ``layer_norm_weight``
    (+1 with ``zero_centered_gamma``) and ``layer_norm_bias``, ``normalization`` and ``eps``.
    The adapter reads the normalized input, as it reads a separate norm's output."""
    weight = module.layer_norm_weight
    if getattr(module, "zero_centered_gamma", False):
        weight = weight + 1
    shape = (x.shape[-1],)
    if getattr(module, "normalization", "LayerNorm") == "RMSNorm":
        return F.rms_norm(x, shape, weight, module.eps)
    return F.layer_norm(x, shape, weight, getattr(module, "layer_norm_bias", None), module.eps)
