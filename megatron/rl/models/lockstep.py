"""Expert-parallel lockstep: the forwards that expert-parallel ranks must run together.

With expert parallelism (EP > 1) every MoE layer exchanges tokens over the TP x EP group, so each
forward (and its backward) is collective over that group: all of its ranks run the same number of
forwards, in the same order, whatever their own batches hold. The token counts of a forward may
differ (``moe.GlooAllGatherDispatcher`` pads them); the number of forwards may not. A rank with
fewer forwards to run than another runs ``padding_forward``s (one token, its output discarded).
Dense models and EP = 1 have no lockstep group: nothing is exchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

__all__ = ["agreed_counts", "expert_lockstep_group", "padding_forward"]


def expert_lockstep_group(model: torch.nn.Module) -> dist.ProcessGroup | None:
    """The TP x EP group the MoE layers of ``model`` exchange tokens over, when expert
    parallelism is on (EP > 1); None otherwise (dense model, EP = 1)."""
    for module in model.modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        if isinstance(dispatcher, MoETokenDispatcher) and dispatcher.ep_size > 1:
            return dispatcher.tp_ep_group
    return None


def agreed_counts(
    counts: list[int], group: dist.ProcessGroup | None, device: torch.device
) -> list[int]:
    """The element-wise largest ``counts`` over ``group`` (collective; ``counts`` as they are
    without a group): how many forwards of each kind every rank of the group runs."""
    if group is None:
        return list(counts)
    value = torch.tensor(counts, dtype=torch.int64, device=device)  # (K,)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return [int(c) for c in value.tolist()]


def padding_forward(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """One forward of a single token (id 0 at position 0, causal): joins the group's exchanges
    for a forward this rank has no rows for. Returns its (1, 1, V/tp) logits; differentiable when
    autograd is on (a backward of ``0 * logits.sum()`` joins the backward's exchanges)."""
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)  # (1, 1)
    return model(ids, torch.zeros_like(ids), None)
