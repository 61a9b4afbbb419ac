"""Mixture-of-experts MLPs: megatron-core's ``MoELayer`` with a router that runs on CPU and CUDA.

``moe_mlp_spec(backend, ...)`` is the ``mlp`` of a layer spec for an architecture with
``num_experts``: megatron-core's ``MoELayer`` with its all-gather token dispatcher, experts as
``SequentialMLP`` of the backend's linear layers (one ``MLP`` per local expert) or, with
``grouped_gemm`` where Transformer Engine imports on CUDA, its grouped GEMM (``TEGroupedMLP``),
and optionally megatron-core's shared expert. What had to change for CPU (gloo), all in
subclasses here, nothing patched:

* ``TopKRouter.gating`` moves its weights to ``torch.cuda.current_device()`` on every call, and
  its ``router_gating_linear`` reads a Transformer Engine name that is undefined without
  Transformer Engine (``NameError``); ``CPUSafeRouter.gating`` computes the same product
  (``F.linear`` in the router dtype) where the weights are.
* The aux-loss logging of ``TopKRouter`` writes megatron-core's global tracker, whose buffers
  are allocated on ``"cuda"``; ``CPUSafeRouter`` keeps the last values on the module instead
  (``last_aux_loss``, ``last_tokens_per_expert``, read by ``moe_statistics``). The aux loss still
  enters the gradient through megatron-core's ``MoEAuxLossAutoScaler`` (its scale: the trainer's
  ``set_aux_loss_scale``), so it also works under full activation recompute.
* ``MoEAlltoAllTokenDispatcher`` creates a CUDA stream when built, so the all-gather dispatcher
  (``allgather``: gathers tokens over the TP x EP group, reduce-scatters the expert outputs) is
  the one used; megatron-core's gather and reduce-scatter functions allocate their outputs on
  ``torch.cuda.current_device()``, so with TP x EP > 1 ``GlooAllGatherDispatcher`` does the same
  two exchanges with device-agnostic autograd functions (reduce-scatter as an all-reduce and a
  slice: gloo has no reduce-scatter). Expert-parallel ranks run different batches, so it pads
  each rank's tokens to the group's largest count with tokens routed to no expert (megatron-core
  requires equal counts) and drops them after the combine.
* ``MoELayer`` refuses to train with TP > 1 without sequence parallelism (a performance guard:
  the result is correct, the all-gather sees each replicated token once per TP rank). The CPU
  tier has no sequence parallelism, so ``build_gpt_model`` gives every ``MoELayer`` the class
  ``GatherMoELayer`` (``moe_layers_train_without_sequence_parallel``), which skips that guard.
  The spec names ``MoELayer`` itself: ``TransformerLayer`` hands its process groups only to the
  exact classes it knows.

Routing replay (a recorded top-k fed back in) plugs into the router: megatron-core's
``topk_routing_with_score_function`` already takes a ``router_replay`` object
(``TransformerConfig.moe_enable_routing_replay``), which ``CPUSafeRouter`` passes on unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.models.backends import BackendSpecProvider
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
from megatron.core.transformer.spec_utils import ModuleSpec

__all__ = [
    "CPUSafeRouter",
    "GatherMoELayer",
    "MoEStatistics",
    "moe_layers_train_without_sequence_parallel",
    "moe_mlp_spec",
    "moe_statistics",
    "set_aux_loss_scale",
    "set_per_token_aux_loss_weight",
]


class CPUSafeRouter(TopKRouter):
    """megatron-core's top-k router that leaves its weights where they are and keeps the last
    aux loss and tokens-per-expert on itself instead of megatron-core's CUDA-side tracker."""

    last_aux_loss: torch.Tensor | None = None
    """The coefficient-weighted load-balancing losses of the last training forward, summed
    (detached, scalar); None when none was computed."""
    last_tokens_per_expert: torch.Tensor | None = None
    """(num_experts,) tokens routed to each expert by the last forward of this rank."""
    per_token_loss_weight: float | None = None
    """Under ``calculate_per_token_loss`` (megatron-core's schedule divides every gradient by the
    global loss-token count), the factor of this micro-batch's aux loss; None: megatron-core's,
    the micro-batch's routed tokens (``set_per_token_aux_loss_weight``)."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        """Router logits (tokens, experts) in the router dtype (``moe_router_dtype``)."""
        dtype = input.dtype
        if self.config.moe_router_dtype == "fp32":
            dtype = torch.float32
        elif self.config.moe_router_dtype == "fp64":
            dtype = torch.float64
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(input.to(dtype), self.weight.to(dtype), bias)  # (..., E)

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None):
        """megatron-core's top-k routing; records the tokens per expert."""
        self.last_aux_loss = None
        probs, routing_map = super().routing(logits, padding_mask=padding_mask)
        self.last_tokens_per_expert = routing_map.detach().sum(dim=0)  # (E,)
        return probs, routing_map

    def attach_and_log_load_balancing_loss(
        self,
        activation: torch.Tensor,
        aux_loss_coeff: float,
        aux_loss: torch.Tensor,
        aux_loss_name: str,
        reduce_group,
        reduce_group_has_dp: bool = False,
        valid_token_count=None,
    ) -> torch.Tensor:
        """Attach ``aux_loss`` (already coefficient-weighted) to the gradient of ``activation``
        as megatron-core does, and keep its value on the router."""
        value = aux_loss.detach().float()
        self.last_aux_loss = value if self.last_aux_loss is None else self.last_aux_loss + value
        if self.calculate_per_token_loss:
            count = valid_token_count if valid_token_count is not None else activation.shape[0]
            if self.per_token_loss_weight is not None:
                count = self.per_token_loss_weight
            return MoEAuxLossAutoScaler.apply(activation, aux_loss * count)
        return MoEAuxLossAutoScaler.apply(activation, aux_loss)


class _GatherFirstDim(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward: the sum of the gradients, this rank's
    rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(group.size())]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)  # (size * n, ...)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatterFirstDim(torch.autograd.Function):
    """Sum over ``group``, then this rank's rows along dim 0; backward: all-gather."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        parts = [torch.empty_like(grad) for _ in range(ctx.group.size())]
        torch.distributed.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts), None


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    total = x.contiguous().clone()
    torch.distributed.all_reduce(total, group=group)
    return total.chunk(group.size())[group.rank()].contiguous()  # (n / size, ...)


class GlooAllGatherDispatcher(MoEAllGatherTokenDispatcher):
    """megatron-core's all-gather token dispatcher with device-agnostic collectives, for token
    counts that may differ across the TP x EP group (expert-parallel ranks run different
    batches): each rank's tokens are padded to the group's largest count with tokens routed to
    no expert, and its own rows are kept after the combine."""

    local_tokens: int = 0
    """Tokens of this rank in the current dispatch (before padding)."""

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Gather tokens, probabilities and the routing map over TP x EP."""
        group = self.tp_ep_group
        if group.size() > 1:
            self.local_tokens = hidden_states.shape[0]
            pad = _group_max(self.local_tokens, group, hidden_states.device) - self.local_tokens
            with torch.no_grad():
                routing = F.pad(self.routing_map.to(torch.uint8), (0, 0, 0, pad))  # (n', E)
                routing = _GatherFirstDim.apply(routing, group)
                self.routing_map = routing.bool()  # (n' * TP * EP, E)
            probs = _GatherFirstDim.apply(F.pad(probs, (0, 0, 0, pad)), group)
            hidden_states = _GatherFirstDim.apply(F.pad(hidden_states, (0, 0, 0, pad)), group)
        return hidden_states, probs

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Sum the expert outputs over TP x EP; keep this rank's tokens."""
        group = self.tp_ep_group
        if group.size() > 1:
            dtype = hidden_states.dtype
            hidden_states = _ReduceScatterFirstDim.apply(
                hidden_states.to(self.local_probs.dtype), group
            ).to(dtype)
            hidden_states = hidden_states[: self.local_tokens]  # (n, H): padding dropped
        return hidden_states


def _group_max(count: int, group, device: torch.device) -> int:
    """The largest ``count`` over ``group`` (collective)."""
    value = torch.tensor([count], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX, group=group)
    return int(value)


class GatherMoELayer(MoELayer):
    """megatron-core's ``MoELayer`` that also trains at TP > 1 without sequence parallelism
    (the all-gather dispatcher computes the same outputs and gradients; megatron-core refuses
    it only as slower than with sequence parallelism, which the CPU tier does not have)."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        """``MoELayer.forward``, its TP-without-sequence-parallelism training guard skipped."""
        if not (self.training and self.attn_tp_group.size() > 1):
            return super().forward(hidden_states, *args, **kwargs)
        self.training = False  # the guard's only reader; routing reads ``router.training``
        try:
            return super().forward(hidden_states, *args, **kwargs)
        finally:
            self.training = True


def moe_mlp_spec(
    backend: BackendSpecProvider, shared_expert: bool = False, grouped_gemm: bool = False
) -> ModuleSpec:
    """The ``mlp`` of a layer spec with routed experts (and megatron-core's shared expert).

    ``grouped_gemm``: the backend's grouped expert GEMM (Transformer Engine's ``TEGroupedMLP``);
    otherwise one ``MLP`` per local expert of ``backend``'s linear layers (``SequentialMLP``).
    """
    fc1, fc2 = backend.column_parallel_linear(), backend.row_parallel_linear()
    if grouped_gemm:
        expert_module, expert_submodules = backend.grouped_mlp_modules(True, False)
    else:
        from megatron.core.transformer.moe.experts import SequentialMLP

        expert_module = SequentialMLP
        expert_submodules = MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2)
    shared = None
    if shared_expert:
        shared = ModuleSpec(
            module=SharedExpertMLP, submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2)
        )
    return ModuleSpec(
        module=MoELayer,
        submodules=MoESubmodules(
            experts=ModuleSpec(module=expert_module, submodules=expert_submodules),
            shared_experts=shared,
            router=CPUSafeRouter,
        ),
    )


def moe_layers_train_without_sequence_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """Give each of ``model``'s ``MoELayer`` the class ``GatherMoELayer`` and each all-gather
    dispatcher the class ``GlooAllGatherDispatcher`` (no state of their own, other methods);
    returns ``model``."""
    for module in model.modules():
        if type(module) is MoELayer:
            module.__class__ = GatherMoELayer
        if type(getattr(module, "token_dispatcher", None)) is MoEAllGatherTokenDispatcher:
            module.token_dispatcher.__class__ = GlooAllGatherDispatcher
    return model


def set_per_token_aux_loss_weight(model: torch.nn.Module, weight: float | None) -> None:
    """Under ``calculate_per_token_loss``, weight each micro-batch's aux loss by ``weight`` (the
    schedule then divides by the loss-token count) instead of by its routed tokens."""
    for module in model.modules():
        if isinstance(module, CPUSafeRouter):
            module.per_token_loss_weight = weight


def set_aux_loss_scale(scale: float, device: torch.device) -> None:
    """The factor of the aux loss's gradient: the weight the trainer gives one micro-batch's
    loss in the update (megatron-core's ``MoEAuxLossAutoScaler``, a process-wide value)."""
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(scale), device=device))


class MoEStatistics(dict):
    """``moe_aux_loss`` (coefficient-weighted aux losses of the last forward, summed over layers;
    absent without an aux loss) and ``moe_load_imbalance`` (over layers, the largest max/mean
    ratio of tokens per expert; 1.0 is perfect balance)."""


def moe_statistics(model: torch.nn.Module) -> MoEStatistics:
    """The statistics of the last forward of ``model``'s routers (empty for a dense model)."""
    routers = [m for m in model.modules() if isinstance(m, CPUSafeRouter)]
    stats = MoEStatistics()
    losses = [r.last_aux_loss for r in routers if r.last_aux_loss is not None]
    if losses:
        stats["moe_aux_loss"] = float(torch.stack(losses).sum())
    counts = [r.last_tokens_per_expert for r in routers if r.last_tokens_per_expert is not None]
    if counts:
        ratios = [c.max().float() / c.float().mean().clamp(min=1e-9) for c in counts]
        stats["moe_load_imbalance"] = float(torch.stack(ratios).max())
    return stats
