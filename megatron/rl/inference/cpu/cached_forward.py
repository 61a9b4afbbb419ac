"""The CPU engine's forward pass: the trained GPT's own parameters, read by one plain-torch program.

An engine step feeds a few tokens per request through the model. At the shapes a CPU runs (1M to
25M parameters, batch 64, one token per row) megatron-core's module stack costs more than its
arithmetic: every layer passes through ~15 ``nn.Module`` calls, autograd-function wrappers of the
tensor-parallel regions, the inference-context checks of ``SelfAttention`` and a rotary table
recomputed (``cos``/``sin``) in each layer for queries and keys alike (profile of a 1M-parameter
decode step: 34% of its time outside any operator).

``CachedForward`` runs the same computation over the same ``nn.Parameter`` objects with the
same operators in the same order: megatron-core's fused QKV layout split per query group, its
unfused rotary embedding (``t * cos + rotate_half(t) * sin``, the same products: the table made
once per step instead of twice per layer, one rotation per layer for the queries and keys of all
groups, the half swap a roll with the sign in the table), ``KVCacheStep.attend`` as the core
attention, bias then residual additions as its bias-dropout-add does them, its unfused (Swi)GLU or
GELU MLP, the final norm and the output layer (norms as torch's functional calls). The embedding
stays megatron-core's module (one call: vocab-parallel lookup and position table). Tensor
parallelism is an all-reduce after each row-parallel projection, as megatron-core's
``reduce_from_tensor_model_parallel_region`` does it. One difference: the
matrix products read contiguous transposed copies of the weights (``TransposedWeights``: ~1.3x
faster GEMMs on this CPU), whose kernel may round the last bit differently; the tests hold the
sampled tokens equal and logprobs within 1e-5 of the modules' forward for every architecture.

The step's tokens run packed, without the padding of the (B, T) input: one pass serves prefill rows
of any lengths and one-token rows together, and no matmul row is spent on padding; only attention
unpacks them (``KVCacheStep.attend_packed``). Only each row's last new token goes through the final
norm and the output layer (prefill rows need no logits at their prompt positions).

A LoRA model's adapters (``megatron.rl.lora``) are added unmerged where the modules' forward
hooks add them: ``LoRAAdapters.adapter_for`` is asked at each adapted layer of each step, so the
current adapter of every policy version (or a multi-adapter server's selected set) is the one used.

``CachedForward.of(model)`` returns None for what it does not reproduce (pipeline parallelism,
sequence parallelism, fused or Transformer Engine modules, MoE, fewer query groups than TP ranks,
mixed-dtype residuals, multi-latent attention...; ``plain_layers.py`` decides): the caller then runs
the model's own forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.rl.inference.cpu.kv_cache import KVCacheStep
from megatron.rl.inference.cpu.plain_layers import PlainLayer, plain_layers
from megatron.rl.lora.model import lora_adapters
from megatron.rl.models.rms_norm import RMSNorm, rms_norm

_MODULE_FIELDS = {
    "linear_qkv": "qkv",
    "linear_proj": "proj",
    "linear_fc1": "fc1",
    "linear_fc2": "fc2",
}
"""megatron-core's name of a linear layer -> its ``PlainLayer`` field."""


class TransposedWeights:
    """Contiguous copies of weights' transposes, for ``x @ W^T`` as a row-major GEMM.

    On this CPU a (64, k) x (k, n) product with the weight stored (n, k) and transposed runs at
    ~75% of the speed of the same product with a contiguous (k, n) copy (``tools/benchmarks``
    decode profile); a copy per weight costs the linear layers' memory once more.

    A weight already stored as its contiguous transpose in the wanted dtype (a LoRA run's frozen
    base, ``megatron.rl.lora.frozen.store_frozen_linear_weights``) is used as it is, without a copy.

    A copy is valid until the weight changes: ``clear`` drops them all (the runner calls it when
    a generation window ends, the only time the trainer updates weights), and each lookup also
    checks the parameter's identity, storage and in-place version counter, so a weight changed
    in place (an optimizer step, ``load_state_dict``) is copied again even inside a window.
    """

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self._copies: dict[int, tuple[torch.Tensor, int, int, torch.Tensor]] = {}
        self.dtype = dtype
        """The copies' dtype (None: the weight's); bfloat16 for a bfloat16 engine: the cast
        autocast would make at every product, made once per window."""

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight.t()`` as a contiguous tensor (the same values, in ``dtype``)."""
        hit = self._copies.get(id(weight))
        if hit is not None:
            owner, version, address, copy = hit
            if owner is weight and version == weight._version and address == weight.data_ptr():
                return copy
        dtype = self.dtype or weight.dtype
        source = weight.detach().t()
        if source.is_contiguous() and source.dtype == dtype:  # stored so (a frozen LoRA base)
            return source
        copy = torch.empty(source.shape, dtype=dtype, device=source.device).copy_(source)
        self._copies[id(weight)] = (weight, weight._version, weight.data_ptr(), copy)
        return copy

    def clear(self) -> None:
        """Forget every copy (the weights may change)."""
        self._copies.clear()


class CachedForward:
    """The model's forward for engine steps over a ``KVCacheStep`` (see the module docstring)."""

    def __init__(
        self,
        model: torch.nn.Module,
        layers: list[PlainLayer],
        tp_group,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.layers = layers
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        c = model.config
        self.activation = c.activation_func
        self.glu = c.gated_linear_unit
        self.glu_offset = c.glu_linear_offset
        self.head_dim = c.kv_channels
        self.heads = c.num_attention_heads // self.tp_size  # query heads of this rank
        self.groups = c.num_query_groups // self.tp_size  # key/value heads of this rank
        self.softmax_scale = c.softmax_scale
        self.rope = getattr(model, "position_embedding_type", None) == "rope"
        self.compute_dtype = compute_dtype
        """The autocast dtype the caller runs it under (None: the weights' own)."""
        self.transposed = TransposedWeights(compute_dtype)
        self.lora = lora_adapters(model)
        """The model's LoRA adapters (None: none), added while they are active."""

    @classmethod
    def of(
        cls, model: torch.nn.Module, tp_group=None, compute_dtype: torch.dtype | None = None
    ) -> CachedForward | None:
        """The plain program of ``model``, or None where it would not compute the same values.

        ``compute_dtype`` (bfloat16 for ``--bf16``): the products run in it under
        ``torch.autocast``, which the caller enters, as the trained model's layers do then: the
        weights' transposed copies are made in it, and so is the RoPE table (megatron-core casts
        its cos/sin to the queries' dtype)."""
        layers = plain_layers(model, tp_group)
        if layers is None:
            return None
        return cls(model, layers, tp_group, compute_dtype)

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, step: KVCacheStep
    ) -> torch.Tensor:
        """Logits at each row's last new token: (B, V/tp), float as the model's.

        ``ids``/``positions`` (B, T) hold ``step.lengths[b]`` new tokens per row (then padding).
        The step's tokens run packed, (N, 1, H), without the padding: prefill rows of different
        lengths and one-token rows share one pass and no matmul row is wasted.
        """
        model = self.model
        if step.all_valid:  # every row has T new tokens: the packed order is row-major
            ids, positions = ids.reshape(1, -1), positions.reshape(1, -1)  # (1, N)
        else:
            ids, positions = ids[step.valid][None], positions[step.valid][None]  # (1, N)
        hidden = model.embedding(input_ids=ids, position_ids=positions)  # (N, 1, H)
        # The embedding's (N, 1, H) is a transpose whose size-1 dimension keeps the stride N*H;
        # torch.matmul does not fold such a tensor into one GEMM (it broadcasts the weight into a
        # batched matmul, ~10x slower at 25M), so restride it as a plain (N, 1, H).
        hidden = hidden.squeeze(1).unsqueeze(1)
        rotary = None
        if self.rope:
            table = model.rotary_pos_emb.at_positions(positions)[:, 0, 0]  # (N, d_rot)
            rotary = _Rotary.of(table, self.compute_dtype or hidden.dtype)
        for index, layer in enumerate(self.layers):
            hidden = self._layer(index, layer, hidden, step, rotary)
        if hidden.shape[0] != step.lengths.shape[0]:  # (B, 1, H): each row's last new token
            hidden = hidden[step.lengths.cumsum(0) - 1]
        hidden = _norm(model.decoder.final_layernorm, hidden)
        if model.share_embeddings_and_output_weights:
            weight = model.shared_embedding_or_output_weight()
        else:
            weight = model.output_layer.weight
        return torch.matmul(hidden, self.transposed(weight))[:, 0]  # (B, V/tp)

    def _layer(self, index, layer: PlainLayer, hidden, step: KVCacheStep, rotary) -> torch.Tensor:
        """One pre-norm transformer layer over the packed tokens: hidden (N, 1, H) -> (N, 1, H)."""
        x = _norm(layer.input_norm, hidden)
        query, key, value = self._qkv(layer, x, rotary)  # (N, 1, heads|groups, d)
        context = step.attend_packed(index, query[:, 0], key[:, 0], value[:, 0], self.softmax_scale)
        context = context[:, None]  # (N, 1, heads * d)
        hidden = self._residual(self._row_parallel(layer, "linear_proj", context), hidden)
        x = _norm(layer.pre_mlp_norm, hidden)
        up = torch.matmul(x, self.transposed(layer.fc1.weight))  # (N, 1, F/tp) or (N, 1, 2F/tp)
        up = self._adapted(layer, "linear_fc1", x, up)  # before the bias, as its skip_bias_add
        if layer.fc1.bias is not None:
            up = up + layer.fc1.bias
        if self.glu:
            gate, linear = torch.chunk(up, 2, dim=-1)
            if self.glu_offset:
                linear = linear + self.glu_offset
            up = self.activation(gate) * linear
        else:
            up = self.activation(up)
        return self._residual(self._row_parallel(layer, "linear_fc2", up), hidden)

    def _qkv(self, layer: PlainLayer, x: torch.Tensor, rotary: _Rotary | None):
        """megatron-core's fused QKV projection split per query group, then the q/k norms and
        the rotary embedding: (N, 1, heads, d), (N, 1, groups, d) twice.

        Without q/k norms, each group's query heads and key are adjacent in the projection's
        output, so one rotation covers them all (the same elementwise products as rotating the
        query and the key apart).
        """
        mixed = torch.matmul(x, self.transposed(layer.qkv.weight))  # (N, 1, groups*(P+2)*d)
        if layer.qkv.bias is not None:
            mixed = mixed + layer.qkv.bias
        mixed = self._adapted(layer, "linear_qkv", x, mixed)  # after the bias, as the layer's
        d, per_group = self.head_dim, self.heads // self.groups
        count = mixed.shape[0]
        mixed = mixed.view(count, 1, self.groups, per_group + 2, d)  # P query heads, key, value
        value = mixed[:, :, :, per_group + 1]  # (N, 1, groups, d)
        if rotary is not None and layer.q_norm is None and layer.k_norm is None:
            query_key = rotary.apply(mixed[:, :, :, : per_group + 1])  # (N, 1, groups, P+1, d)
            query = query_key[:, :, :, :per_group].reshape(count, 1, self.heads, d)
            return query, query_key[:, :, :, per_group], value
        query = mixed[:, :, :, :per_group].reshape(count, 1, self.heads, d)
        key = mixed[:, :, :, per_group]
        if layer.q_norm is not None:
            query = _norm(layer.q_norm, query)
        if layer.k_norm is not None:
            key = _norm(layer.k_norm, key)
        if rotary is not None:
            query, key = rotary.apply(query), rotary.apply(key)
        return query, key, value

    def _row_parallel(self, layer: PlainLayer, name: str, x: torch.Tensor):
        """A row-parallel projection without its bias: (output summed over TP, bias)."""
        module = layer.proj if name == "linear_proj" else layer.fc2
        out = torch.matmul(x, self.transposed(module.weight))
        if self.tp_size > 1:
            out = out.contiguous()
            dist.all_reduce(out, group=self.tp_group)
        return self._adapted(layer, name, x, out), module.bias

    def _adapted(self, layer: PlainLayer, name: str, x: torch.Tensor, out: torch.Tensor):
        """``out`` plus the current LoRA adapter of the layer's ``name`` on input ``x``
        (``LoRAAdapters.adapter_for``: the forward hook's sum, at the same point)."""
        if self.lora is None:
            return out
        module = getattr(layer, _MODULE_FIELDS[name])
        adapter = self.lora.adapter_for(module)
        if adapter is None:
            dtype = self.lora.output_dtype(module)
            return out if dtype is None else out.to(dtype)
        return adapter.added_to(out, x, self.transposed)

    @staticmethod
    def _residual(out_bias, residual: torch.Tensor) -> torch.Tensor:
        """megatron-core's bias-dropout-add at dropout 0: residual + (out + bias), the residual
        cast to the output's dtype first (bfloat16 under autocast, as megatron-core does)."""
        out, bias = out_bias
        if bias is not None:
            out = out + bias
        return residual.to(out.dtype) + out


@dataclass(frozen=True)
class _Rotary:
    """One step's RoPE table in the form ``apply`` uses, computed once for every layer."""

    cos: torch.Tensor  # (N, d_rot)
    sin_signed: torch.Tensor  # (N, d_rot): sin with its first half negated

    @classmethod
    def of(cls, angles: torch.Tensor, dtype: torch.dtype) -> _Rotary:
        """The table for angles (N, d_rot), in the activations' dtype."""
        sin = torch.sin(angles)
        half = angles.shape[-1] // 2
        sin_signed = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        return cls(torch.cos(angles).to(dtype), sin_signed.to(dtype))

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """megatron-core's unfused RoPE (``_apply_rotary_pos_emb_bshd``) on t (N, 1, ..., d).

        ``rotate_half(t) * sin`` is ``cat(-x2, x1) * sin``; here the half swap is a roll and the
        sign sits in the table: ``roll(t) * sin_signed`` has the same values (negation is exact).
        """
        count, dim = self.cos.shape
        shape = (count,) + (1,) * (t.dim() - 2) + (dim,)
        cos, sin_signed = self.cos.view(shape), self.sin_signed.view(shape)
        if dim < t.shape[-1]:
            rotated, passed = t[..., :dim], t[..., dim:]
        else:
            rotated, passed = t, None
        out = rotated * cos + torch.roll(rotated, dim // 2, dims=-1) * sin_signed
        return out if passed is None else torch.cat((out, passed), dim=-1)


def _norm(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for torch's own LayerNorm/RMSNorm and ``rms_norm.RMSNorm`` as the functional
    call their ``forward`` makes (without ``nn.Module.__call__``: ~10 norms per decode step; an
    RMSNorm of bfloat16 ``x`` with float32 weights as ``rms_norm``); others: ``module(x)``."""
    kind = type(module)
    if kind is torch.nn.RMSNorm or kind is RMSNorm:  # bfloat16 x, float32 weight: no warning
        return rms_norm(module, x)
    if kind is torch.nn.LayerNorm:
        return F.layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)
    return module(x)
