"""Tensor mapping between Hugging Face Llama-style weights and megatron-core GPTModel shards.

Names (layer ``i``; HF on the left, megatron-core ``GPTModel.state_dict()`` on the right):

* ``model.embed_tokens.weight`` -> ``embedding.word_embeddings.weight``
* ``model.layers.i.input_layernorm.weight`` -> ``decoder.layers.i.input_layernorm.weight``
  (SDPA/local spec) or ``decoder.layers.i.self_attention.linear_qkv.layer_norm_weight``
  (Transformer Engine spec, norm fused into the linear layer)
* ``model.layers.i.self_attn.{q,k,v}_proj.{weight,bias}`` ->
  ``decoder.layers.i.self_attention.linear_qkv.{weight,bias}``
* ``model.layers.i.self_attn.o_proj.{weight,bias}`` -> ``...self_attention.linear_proj.*``
* ``model.layers.i.self_attn.{q,k}_norm.weight`` -> ``...self_attention.{q,k}_layernorm.weight``
* ``model.layers.i.post_attention_layernorm.weight`` -> ``decoder.layers.i.pre_mlp_layernorm
  .weight`` (local) or ``decoder.layers.i.mlp.linear_fc1.layer_norm_weight`` (TE)
* ``model.layers.i.mlp.{gate,up}_proj.{weight,bias}`` -> ``...mlp.linear_fc1.*``
* ``model.layers.i.mlp.down_proj.{weight,bias}`` -> ``...mlp.linear_fc2.*``
* ``model.norm.weight`` -> ``decoder.final_layernorm.weight``
* ``lm_head.weight`` -> ``output_layer.weight`` (untied models only)

Layouts (megatron-core 0.16.1, ``SelfAttention.get_query_key_value_tensors`` and ``MLP.glu``):

* QKV: output rows grouped per key/value head ("query group") ``g``: the ``heads/groups`` query
  heads of the group, then its key head, then its value head, each ``kv_channels`` rows:
  ``[q(g, 0) .. q(g, h/g - 1), k(g), v(g)]`` for g = 0 .. groups-1.
* SwiGLU ``linear_fc1``: each TP rank holds ``[gate shard; up shard]`` (``torch.chunk(x, 2)`` of
  its local output), so the TP=1 weight is ``[gate; up]`` and a TP=2 rank r holds
  ``[gate[r]; up[r]]``: not a slice of the TP=1 weight.

TP sharding (rank r of t): column-parallel (``linear_qkv`` by query groups, ``linear_fc1``
per branch, biases alike) split output rows; row-parallel (``linear_proj``, ``linear_fc2``) split
input columns, their biases are replicated; the vocab-parallel embedding and output layer split
the vocabulary rows after padding it with zero rows to ``GPTArchitecture.vocab_size``; norms are
replicated. Grouped-query attention needs ``num_query_groups`` divisible by t.

Which optional tensors a model has (q/k/v biases, all biases, q/k norms, ``lm_head``) follows
from the ``GPTArchitecture`` flags alone (``add_qkv_bias``, ``add_bias_linear``, ``qk_layernorm``,
``untie_embeddings_and_output_weights``), which a family's ``HFFamily`` entry sets
(``families/``): the names above are those of every supported family.

Tensors are read through a ``TensorSource`` (a ``safetensors`` checkpoint reads only the rank's
slices). Mapping never changes values: HF -> megatron -> HF is bitwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Protocol

import torch

from megatron.rl.models.architecture import GPTArchitecture
from megatron.rl.models.hf.errors import HFCheckpointError
from megatron.rl.models.hf.experts import (
    expert_readers,
    hf_expert_shapes,
    hf_experts_from_megatron,
)
from megatron.rl.models.hf.families.base import MoENames


def moe_names(arch: GPTArchitecture, family: str | None) -> MoENames | None:
    """The expert names of ``family`` for a mixture-of-experts ``arch`` (None for a dense one);
    ValueError if the family has no experts or none is given."""
    if arch.num_experts is None:
        return None
    from megatron.rl.models.hf.families import family_named

    if family is None:
        raise ValueError("a mixture-of-experts architecture needs its Hugging Face family")
    names = family_named(family).moe
    if names is None:
        raise ValueError(f"family {family!r} has no mixture of experts")
    return names


class TensorSource(Protocol):
    """Named tensors that can be read in slices along one dimension."""

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The full shape of ``name``; None if the source has no such tensor."""
        ...

    def read(
        self, name: str, dim: int = 0, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """``name[start:stop]`` along ``dim`` (0 or 1) as a torch tensor."""
        ...


def hf_tensor_shapes(
    arch: GPTArchitecture, vocab_size: int, family: str | None = None
) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of ``arch`` with ``vocab_size`` rows holds, with its shape
    (``family`` names the experts of a mixture of experts)."""
    experts = moe_names(arch, family)
    h, d, ffn = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    q_rows, kv_rows = arch.num_attention_heads * d, arch.query_groups * d
    shapes = {"model.embed_tokens.weight": (vocab_size, h), "model.norm.weight": (h,)}
    if arch.untie_embeddings_and_output_weights:
        shapes["lm_head.weight"] = (vocab_size, h)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (q_rows, h),
                p + "self_attn.k_proj.weight": (kv_rows, h),
                p + "self_attn.v_proj.weight": (kv_rows, h),
                p + "self_attn.o_proj.weight": (h, q_rows),
            }
        )
        if experts is not None:
            shapes.update(hf_expert_shapes(arch, experts, i))
        else:
            shapes[p + "mlp.gate_proj.weight"] = (ffn, h)
            shapes[p + "mlp.up_proj.weight"] = (ffn, h)
            shapes[p + "mlp.down_proj.weight"] = (h, ffn)
        if arch.add_bias_linear or arch.add_qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_rows,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_rows,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_rows,)
        if arch.add_bias_linear:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if arch.add_bias_linear and experts is None:
            shapes[p + "mlp.gate_proj.bias"] = (ffn,)
            shapes[p + "mlp.up_proj.bias"] = (ffn,)
            shapes[p + "mlp.down_proj.bias"] = (h,)
        if arch.qk_layernorm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
    return shapes


def _norm_names(i: int, fused_norms: bool, moe: bool = False) -> tuple[str, str]:
    """Names of layer i's input norm and pre-MLP norm weights in the megatron-core model (a
    mixture of experts never fuses its norm)."""
    p = f"decoder.layers.{i}."
    if fused_norms:
        return (
            p + "self_attention.linear_qkv.layer_norm_weight",
            p + ("pre_mlp_layernorm.weight" if moe else "mlp.linear_fc1.layer_norm_weight"),
        )
    return p + "input_layernorm.weight", p + "pre_mlp_layernorm.weight"


def megatron_shard_from_hf(
    arch: GPTArchitecture,
    source: TensorSource,
    vocab_size: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    fused_norms: bool = False,
    **experts,
) -> dict[str, torch.Tensor]:
    """TP rank ``tp_rank``'s megatron-core tensors of an HF checkpoint (values unchanged): every
    reader of ``megatron_shard_readers`` called (``experts``: its ``family``, ``ep_rank``,
    ``ep_size``)."""
    readers = megatron_shard_readers(
        arch, source, vocab_size, tp_rank, tp_size, fused_norms, **experts
    )
    return {name: read() for name, read in readers.items()}


def megatron_shard_readers(
    arch: GPTArchitecture,
    source: TensorSource,
    vocab_size: int,
    tp_rank: int = 0,
    tp_size: int = 1,
    fused_norms: bool = False,
    family: str | None = None,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> dict[str, Callable[[], torch.Tensor]]:
    """For each megatron-core tensor of TP rank ``tp_rank``, what reads it from an HF checkpoint
    when called: a loader that copies them one at a time holds one converted tensor at a time.

    ``vocab_size``: rows of the HF embedding; rows up to ``arch.vocab_size`` are zeros.
    ``fused_norms``: name the input norms as Transformer Engine's fused layers do. A mixture of
    experts: ``family`` names its tensors, EP rank ``ep_rank`` of ``ep_size`` reads its local
    experts (``experts.py``).
    """
    arch.validate(tp_size)
    arch.validate_expert_parallel(ep_size)
    experts = moe_names(arch, family)
    d = arch.head_dim
    groups = arch.query_groups // tp_size  # query groups of this rank
    q_rows = groups * (arch.num_attention_heads // arch.query_groups) * d
    kv_rows, f_rows = groups * d, arch.ffn_hidden_size // tp_size
    r = tp_rank

    def rows(name: str, n: int) -> torch.Tensor:
        return source.read(name, 0, r * n, (r + 1) * n)

    def cols(name: str, n: int) -> torch.Tensor:
        return source.read(name, 1, r * n, (r + 1) * n)

    def qkv(attn: str, kind: str) -> torch.Tensor:
        """Interleave this rank's q, k, v rows per query group (megatron-core's layout)."""
        q = rows(attn + f"q_proj.{kind}", q_rows)  # (q_rows, ...)
        k = rows(attn + f"k_proj.{kind}", kv_rows)  # (kv_rows, ...)
        v = rows(attn + f"v_proj.{kind}", kv_rows)
        tail = q.shape[1:]
        parts = [t.reshape(groups, -1, *tail) for t in (q, k, v)]
        return torch.cat(parts, dim=1).reshape(-1, *tail)  # (groups * (q/g + 2) * d, ...)

    def gate_up(mlp: str, kind: str) -> torch.Tensor:
        """This rank's ``[gate_r; up_r]`` rows (megatron-core's SwiGLU ``linear_fc1``)."""
        return torch.cat(
            [rows(mlp + f"gate_proj.{kind}", f_rows), rows(mlp + f"up_proj.{kind}", f_rows)]
        )

    read = source.read
    vocab_rows = arch.vocab_size // tp_size
    out: dict[str, Callable[[], torch.Tensor]] = {
        "embedding.word_embeddings.weight": partial(
            _vocab_rows, source, "model.embed_tokens.weight", vocab_size, r * vocab_rows, vocab_rows
        ),
        "decoder.final_layernorm.weight": partial(read, "model.norm.weight"),
    }
    if arch.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = partial(
            _vocab_rows, source, "lm_head.weight", vocab_size, r * vocab_rows, vocab_rows
        )
    biases = ("weight", "bias") if arch.add_bias_linear else ("weight",)
    for i in range(arch.num_layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        hf_attn, attn = hf + "self_attn.", mc + "self_attention."
        in_norm, mlp_norm = _norm_names(i, fused_norms, experts is not None)
        out[in_norm] = partial(read, hf + "input_layernorm.weight")
        out[mlp_norm] = partial(read, hf + "post_attention_layernorm.weight")
        out[attn + "linear_qkv.weight"] = partial(qkv, hf_attn, "weight")
        if arch.add_bias_linear or arch.add_qkv_bias:
            out[attn + "linear_qkv.bias"] = partial(qkv, hf_attn, "bias")
        out[attn + "linear_proj.weight"] = partial(cols, hf_attn + "o_proj.weight", q_rows)
        if arch.qk_layernorm:
            out[attn + "q_layernorm.weight"] = partial(read, hf_attn + "q_norm.weight")
            out[attn + "k_layernorm.weight"] = partial(read, hf_attn + "k_norm.weight")
        if arch.add_bias_linear:
            out[attn + "linear_proj.bias"] = partial(read, hf_attn + "o_proj.bias")
        if experts is not None:
            out.update(expert_readers(arch, experts, read, i, r, tp_size, ep_rank, ep_size))
            continue
        for kind in biases:
            out[mc + f"mlp.linear_fc1.{kind}"] = partial(gate_up, hf + "mlp.", kind)
        out[mc + "mlp.linear_fc2.weight"] = partial(cols, hf + "mlp.down_proj.weight", f_rows)
        if arch.add_bias_linear:
            out[mc + "mlp.linear_fc2.bias"] = partial(read, hf + "mlp.down_proj.bias")
    return out


def _vocab_rows(
    source: TensorSource, name: str, vocab_size: int, start: int, count: int
) -> torch.Tensor:
    """Rows ``start .. start+count`` of an embedding of ``vocab_size`` rows, zeros past its end."""
    lo, hi = min(start, vocab_size), min(start + count, vocab_size)
    part = source.read(name, 0, lo, hi)  # (hi - lo, H), possibly empty
    if part.shape[0] == count:
        return part
    padded = part.new_zeros(count, part.shape[1])
    padded[: part.shape[0]] = part
    return padded


def hf_from_megatron(
    arch: GPTArchitecture,
    shards: Sequence[Mapping[str, torch.Tensor]],
    vocab_size: int,
    family: str | None = None,
) -> dict[str, torch.Tensor]:
    """HF tensors of a model given as the state dicts of all its TP ranks, in rank order (a
    mixture of experts: in the layout of EP=1, its tensors named as ``family``'s).

    One state dict is a TP=1 model. Local and Transformer Engine norm names are both
    recognized; ``_extra_state`` entries are ignored; any other unknown name is an error.
    ``vocab_size``: HF embedding rows (the padding rows past it are dropped).
    """
    tp = len(shards)
    arch.validate(tp)
    shards = [{k: v for k, v in s.items() if not k.endswith("_extra_state")} for s in shards]
    fused = "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in shards[0]
    experts = moe_names(arch, family)
    used: set[str] = set()
    d = arch.head_dim
    groups = arch.query_groups // tp
    q_rows = groups * (arch.num_attention_heads // arch.query_groups) * d

    def get(rank: int, name: str) -> torch.Tensor:
        if name not in shards[rank]:
            raise HFCheckpointError(f"TP rank {rank}'s state dict has no tensor {name!r}")
        used.add(name)
        return shards[rank][name]

    def cat(name: str, dim: int) -> torch.Tensor:
        return torch.cat([get(r, name) for r in range(tp)], dim=dim)

    out = {
        "model.embed_tokens.weight": cat("embedding.word_embeddings.weight", 0)[
            :vocab_size
        ].clone(),
        "model.norm.weight": get(0, "decoder.final_layernorm.weight"),
    }
    if arch.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = cat("output_layer.weight", 0)[:vocab_size].clone()
    biases = ("weight", "bias") if arch.add_bias_linear else ("weight",)
    for i in range(arch.num_layers):
        hf, mc = f"model.layers.{i}.", f"decoder.layers.{i}."
        hf_attn, attn = hf + "self_attn.", mc + "self_attention."
        in_norm, mlp_norm = _norm_names(i, fused, experts is not None)
        out[hf + "input_layernorm.weight"] = get(0, in_norm)
        out[hf + "post_attention_layernorm.weight"] = get(0, mlp_norm)
        qkv_kinds = ("weight", "bias") if arch.add_bias_linear or arch.add_qkv_bias else ("weight",)
        for kind in qkv_kinds:
            parts = []
            for r in range(tp):
                w = get(r, attn + f"linear_qkv.{kind}")
                tail = w.shape[1:]
                grouped = w.reshape(groups, -1, *tail)  # (groups, (q/g + 2) * d, ...)
                q, k, v = grouped.split([q_rows // groups, d, d], dim=1)
                parts.append([t.reshape(-1, *tail) for t in (q, k, v)])
            for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                out[hf_attn + f"{proj}.{kind}"] = torch.cat([p[j] for p in parts])
        out[hf_attn + "o_proj.weight"] = cat(attn + "linear_proj.weight", 1)
        if arch.qk_layernorm:
            out[hf_attn + "q_norm.weight"] = get(0, attn + "q_layernorm.weight")
            out[hf_attn + "k_norm.weight"] = get(0, attn + "k_layernorm.weight")
        if arch.add_bias_linear:
            out[hf_attn + "o_proj.bias"] = get(0, attn + "linear_proj.bias")
        if experts is not None:
            out.update(hf_experts_from_megatron(arch, experts, get, tp, i))
            continue
        for kind in biases:
            halves = [get(r, mc + f"mlp.linear_fc1.{kind}").chunk(2) for r in range(tp)]
            out[hf + f"mlp.gate_proj.{kind}"] = torch.cat([g for g, _ in halves])
            out[hf + f"mlp.up_proj.{kind}"] = torch.cat([u for _, u in halves])
        out[hf + "mlp.down_proj.weight"] = cat(mc + "mlp.linear_fc2.weight", 1)
        if arch.add_bias_linear:
            out[hf + "mlp.down_proj.bias"] = get(0, mc + "mlp.linear_fc2.bias")
    unknown = sorted(set(shards[0]) - used)
    if unknown:
        raise HFCheckpointError(f"state dict tensors with no HF counterpart: {unknown}")
    return {k: v.contiguous() for k, v in out.items()}
