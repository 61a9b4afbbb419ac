"""The tensors of a mixture of experts: Hugging Face names <-> megatron-core ``MoELayer`` shards.

Names of layer ``i`` (``block``, ``gate``/``up``/``down``: the family's ``MoENames``; expert
``j`` of ``E``, local index ``l = j - ep_rank * E / ep_size`` on its expert-parallel rank):

* ``model.layers.i.<block>.gate.weight`` (E, H) -> ``decoder.layers.i.mlp.router.weight``
  (replicated over TP and EP);
* ``model.layers.i.<block>.experts.j.{gate,up}.weight`` (F, H) ->
  ``decoder.layers.i.mlp.experts.local_experts.l.linear_fc1.weight``: TP rank r holds
  ``[gate[r]; up[r]]`` of F / tp rows each (as a dense SwiGLU MLP);
* ``model.layers.i.<block>.experts.j.down.weight`` (H, F) -> ``...local_experts.l.linear_fc2
  .weight``, columns split over TP;
* ``model.layers.i.post_attention_layernorm.weight`` -> ``decoder.layers.i.pre_mlp_layernorm
  .weight`` (never fused into a linear layer, also with Transformer Engine).

Expert TP is megatron-core's default ``expert_tensor_parallel_size`` (= TP). Export takes state
dicts in the layout of an EP=1 model (``checkpoint.gather_tensor_parallel_state_dicts`` renames
each EP rank's local experts to their global index).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from megatron.rl.models.architecture import GPTArchitecture
from megatron.rl.models.hf.families.base import MoENames

LOCAL_EXPERT = "decoder.layers.{i}.mlp.experts.local_experts.{l}."


def hf_expert_shapes(arch: GPTArchitecture, names: MoENames, i: int) -> dict[str, tuple]:
    """Layer ``i``'s router and expert tensors in an HF checkpoint, with their shapes."""
    h, f, p = arch.hidden_size, arch.expert_ffn_hidden_size, f"model.layers.{i}.{names.block}."
    shapes = {p + "gate.weight": (arch.num_experts, h)}
    for j in range(arch.num_experts):
        e = f"{p}experts.{j}."
        shapes[e + f"{names.gate}.weight"] = (f, h)
        shapes[e + f"{names.up}.weight"] = (f, h)
        shapes[e + f"{names.down}.weight"] = (h, f)
    return shapes


def expert_readers(
    arch: GPTArchitecture,
    names: MoENames,
    read: Callable[..., torch.Tensor],
    i: int,
    tp_rank: int,
    tp_size: int,
    ep_rank: int,
    ep_size: int,
) -> dict[str, Callable[[], torch.Tensor]]:
    """What reads each of layer ``i``'s router and local expert tensors for a (TP, EP) rank;
    ``read(name, dim, start, stop)`` reads a slice of an HF tensor."""
    p, n = f"model.layers.{i}.{names.block}.", arch.expert_ffn_hidden_size // tp_size
    r, local = tp_rank, arch.num_experts // ep_size

    def gate_up(expert: str) -> torch.Tensor:
        gate = read(expert + f"{names.gate}.weight", 0, r * n, (r + 1) * n)  # (F/tp, H)
        up = read(expert + f"{names.up}.weight", 0, r * n, (r + 1) * n)
        return torch.cat([gate, up])  # (2F/tp, H)

    out = {f"decoder.layers.{i}.mlp.router.weight": partial(read, p + "gate.weight")}
    for l in range(local):
        expert, mc = f"{p}experts.{ep_rank * local + l}.", LOCAL_EXPERT.format(i=i, l=l)
        out[mc + "linear_fc1.weight"] = partial(gate_up, expert)
        out[mc + "linear_fc2.weight"] = partial(
            read, expert + f"{names.down}.weight", 1, r * n, (r + 1) * n
        )
    return out


def hf_experts_from_megatron(
    arch: GPTArchitecture,
    names: MoENames,
    get: Callable[[int, str], torch.Tensor],
    tp: int,
    i: int,
) -> dict[str, torch.Tensor]:
    """Layer ``i``'s HF router and expert tensors from ``get(tp_rank, name)`` of an EP=1 model."""
    p = f"model.layers.{i}.{names.block}."
    out = {p + "gate.weight": get(0, f"decoder.layers.{i}.mlp.router.weight")}
    for j in range(arch.num_experts):
        expert, mc = f"{p}experts.{j}.", LOCAL_EXPERT.format(i=i, l=j)
        halves = [get(r, mc + "linear_fc1.weight").chunk(2) for r in range(tp)]
        out[expert + f"{names.gate}.weight"] = torch.cat([g for g, _ in halves])
        out[expert + f"{names.up}.weight"] = torch.cat([u for _, u in halves])
        down = [get(r, mc + "linear_fc2.weight") for r in range(tp)]
        out[expert + f"{names.down}.weight"] = torch.cat(down, dim=1)
    return out
