"""The mixture-of-experts part of a training update: the aux loss's gradient weight and the
step's ``moe_aux_loss`` / ``moe_load_imbalance`` / ``moe_routing_mismatch`` metrics (none for a
dense model).

``moe_routing_mismatch`` (with ``--record-rollout-routing`` or ``--use-rollout-routing-replay``)
is the share of the update's tokens with an engine record whose trainer routing (the router's
own top-k under the weights being trained, before any replay) differs from the engine's in at
least one MoE layer: at forced lag 0 on the first iteration, the routing mismatch between the
engine and pi_old.

Both tiers give the aux loss the gradient of its mean over the global batch's micro-batches:
each micro-batch's aux loss weighs 1 / (micro-batches x data-parallel ranks) (the DP gradients
are summed), whatever the policy loss's normalization. The CPU tier runs its micro-batches
itself and sets that factor as megatron-core's ``MoEAuxLossAutoScaler`` scale (as megatron-core's
schedule does without ``calculate_per_token_loss``). The CUDA tier runs megatron-core's schedule
with ``calculate_per_token_loss``, which would weight a micro-batch's aux loss by its routed
tokens over the global loss-token count N (with a per-sequence loss aggregation, hundreds of
times the policy loss's weight); instead each router multiplies it by N / (micro-batches x DP)
(``set_per_token_aux_loss_weight``) and the schedule's division by N leaves the same factor.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron.rl.models.moe import (
    CPUSafeRouter,
    moe_statistics,
    set_aux_loss_scale,
    set_per_token_aux_loss_weight,
)
from megatron.rl.models.routing_replay import routing_mismatch
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.train.step import StepResult


def has_moe_layers(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or its wrapper) has routed experts."""
    return any(isinstance(m, CPUSafeRouter) for m in model.modules())


def set_micro_batch_aux_loss_scale(
    model: torch.nn.Module, micro_batches: int, dp_size: int, device: torch.device
) -> None:
    """Weight each micro-batch's aux-loss gradient by 1 / (``micro_batches`` x ``dp_size``)
    (a no-op for a dense model)."""
    if has_moe_layers(model):
        set_aux_loss_scale(1.0 / max(micro_batches * dp_size, 1), device)


def set_schedule_aux_loss_weight(
    model: torch.nn.Module, local_normalizer: float, micro_batches: int, ctx: ParallelContext
) -> None:
    """Under megatron-core's schedule with ``calculate_per_token_loss`` (every gradient divided
    by N, the sum over DP ranks of each rank's ``local_normalizer``), weight each micro-batch's
    aux loss by N / (``micro_batches`` x DP ranks). Collective over DP for an MoE model; a no-op
    for a dense one."""
    if not has_moe_layers(model):
        return
    total = torch.tensor([float(local_normalizer)], dtype=torch.float64, device=ctx.device)
    if ctx.dp_size > 1:
        dist.all_reduce(total, group=ctx.dp_group)
    set_per_token_aux_loss_weight(model, float(total) / max(micro_batches * ctx.dp_size, 1))


class MoEStepStats:
    """The routers' statistics of each micro-batch forward of one update (``record``), reduced
    to the step's metrics (``metrics``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.enabled = has_moe_layers(model)
        self.aux: list[float] = []
        self.imbalance: list[float] = []
        self.routing = [0, 0]
        """Tokens whose routing differs from the engine's record, tokens with a record."""
        if self.enabled:
            routing_mismatch(model)  # counts of earlier forwards (pi_old up front) do not count

    def record(self) -> None:
        """Keep the statistics of the forward that just ran."""
        if not self.enabled:
            return
        differing, compared = routing_mismatch(self.model)
        self.routing = [self.routing[0] + differing, self.routing[1] + compared]
        stats = moe_statistics(self.model)
        if "moe_aux_loss" in stats:
            self.aux.append(stats["moe_aux_loss"])
        if "moe_load_imbalance" in stats:
            self.imbalance.append(stats["moe_load_imbalance"])

    def metrics(
        self,
        dp_group: dist.ProcessGroup | None,
        stage_group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> dict[str, float]:
        """``moe_aux_loss``: the mean over micro-batches (and DP ranks) of the summed layers'
        coefficient-weighted aux losses (summed over pipeline stages: ``stage_group``);
        ``moe_load_imbalance``: the largest max/mean tokens-per-expert ratio of any layer and
        micro-batch; ``moe_routing_mismatch``: differing / compared tokens over DP ranks (absent
        when no token has an engine record). Collective over the given groups; {} for a dense
        model."""
        if not self.enabled:
            return {}
        aux = torch.tensor(
            [sum(self.aux) / max(len(self.aux), 1), float(bool(self.aux))],
            dtype=torch.float64,
            device=device,
        )
        imbalance = torch.tensor([max(self.imbalance, default=0.0)], device=device)
        routing = torch.tensor(self.routing, dtype=torch.float64, device=device)
        if stage_group is not None:
            dist.all_reduce(aux[:1], group=stage_group)
            dist.all_reduce(imbalance, op=dist.ReduceOp.MAX, group=stage_group)
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(aux, group=dp_group)
            dist.all_reduce(imbalance, op=dist.ReduceOp.MAX, group=dp_group)
            dist.all_reduce(routing, group=dp_group)
        out = {}
        if routing[1] > 0:
            out["moe_routing_mismatch"] = float(routing[0] / routing[1])
        if aux[1] > 0:
            out["moe_aux_loss"] = float(aux[0] / aux[1])
        if self.imbalance:
            out["moe_load_imbalance"] = float(imbalance[0])
        return out


def with_moe_metrics(result: StepResult, metrics: dict[str, float]) -> StepResult:
    """``result`` with ``metrics`` added to its metrics (unchanged when there are none)."""
    if not metrics:
        return result
    return dataclasses.replace(result, metrics={**result.metrics, **metrics})
