"""CPU-tier optimizer: torch AdamW, megatron-core's LR schedule, DP all-reduce and grad clipping.

AdamW is torch's fused implementation (one pass over each tensor, on CPU and CUDA alike; Hugging
Face's ``Trainer`` defaults to it too): at the 26M-parameter Llama shape one step takes 29 ms on
one CPU thread, against 95-127 ms for the default multi-tensor (``foreach``) implementation.

megatron-core's DistributedDataParallel and ``get_megatron_optimizer`` hard-code CUDA devices, so
the CPU tier reduces gradients itself (one flattened all-reduce per step over the data-parallel
group) and computes the global gradient norm counting each tensor-parallel shard once. With
expert parallelism the experts' gradients are reduced over the expert-data-parallel group (the
DP / EP ranks holding the same experts; megatron-core marks those parameters ``allreduce =
False``) and their squared norms summed over the TP x EP ranks that together hold every expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate


@dataclass(frozen=True)
class OptimizerSettings:
    """The optimizer and LR schedule of both tiers (``config.optimizer_settings``)."""

    lr: float
    """``--lr``: the peak learning rate."""
    min_lr: float
    """``--min-lr``: where the decay ends."""
    weight_decay: float
    """``--weight-decay`` (decoupled; none on biases and norms)."""
    adam_beta1: float
    """``--adam-beta1``."""
    adam_beta2: float
    """``--adam-beta2``."""
    adam_eps: float
    """``--adam-eps``."""
    clip_grad: float
    """``--clip-grad``: the gradient norm's cap (0: measured, never clipped)."""
    warmup_iters: int
    """``--lr-warmup-iters``."""
    decay_iters: int
    """``--lr-decay-iters``, else ``--train-iters``."""
    decay_style: str
    """``--lr-decay-style``."""
    train_iters: int
    """``--train-iters``: the weight-decay schedule's length."""
    distributed: bool = False
    """``--use-distributed-optimizer`` (CUDA tier): optimizer state sharded over DP."""
    check_finite: bool = False
    """``--check-for-nan-in-loss-and-grad``: megatron-core's DDP checks each rank's gradients
    (CUDA tier)."""


def build_optimizer(
    model: torch.nn.Module, settings: OptimizerSettings
) -> tuple[torch.optim.AdamW, OptimizerParamScheduler]:
    """Fused AdamW with no weight decay on biases/norms, and warmup + decay down to
    ``--min-lr``."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or name.endswith(".bias") else decay).append(param)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}],
        lr=settings.lr,
        betas=(settings.adam_beta1, settings.adam_beta2),
        eps=settings.adam_eps,
        weight_decay=settings.weight_decay,
        fused=True,
    )
    return optimizer, build_scheduler(optimizer, settings)


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)``, keeping this optimizer's implementation.

    torch restores every option saved with a parameter group, ``fused`` and ``foreach``
    included, so a checkpoint written by the multi-tensor AdamW would otherwise resume on it.
    """
    kept = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, options in zip(optimizer.param_groups, kept):
        group.update(options)


def build_scheduler(optimizer: Any, settings: OptimizerSettings) -> OptimizerParamScheduler:
    """Warmup + decay down to ``--min-lr`` at ``--lr-decay-iters`` (default ``--train-iters``),
    stepped once per iteration (both tiers; ``optimizer`` is a torch or a megatron-core optimizer).

    megatron-core's scheduler needs warmup < decay; a warmup longer than the decay (as with
    ``--train-iters 5`` and the default warmup) decays over one iteration after the warmup, so the
    run only warms up.
    """
    s = settings
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if s.warmup_iters > 0 else s.lr,
        max_lr=s.lr,
        min_lr=s.min_lr,
        lr_warmup_steps=s.warmup_iters,
        lr_decay_steps=max(s.decay_iters, s.warmup_iters + 1),
        lr_decay_style=s.decay_style,
        start_wd=s.weight_decay,
        end_wd=s.weight_decay,
        wd_incr_steps=max(s.train_iters, 1),
        wd_incr_style="constant",
    )


def is_expert_parallel(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` is one expert-parallel rank's own (megatron-core's ``allreduce =
    False``, set on expert weights at EP > 1): reduced over expert data parallelism only."""
    return not getattr(param, "allreduce", True)


def allreduce_gradients(params: list[torch.nn.Parameter], group: dist.ProcessGroup | None) -> None:
    """Sum gradients over ``group`` (the data-parallel group, or the expert-data-parallel group
    for expert-parallel parameters) with one flattened all-reduce."""
    if group is None or dist.get_world_size(group) == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=group)
    for grad, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(reduced)


def allreduce_per_head_norm_gradients(
    model: torch.nn.Module, tp_group: dist.ProcessGroup | None
) -> None:
    """Sum over TP the gradients of the query and key norms (``--qk-layernorm``: one weight that
    every head shares, so each TP rank's heads contribute part of its gradient), as megatron-core's
    ``finalize_model_grads`` does; other replicated weights see every token on every TP rank."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return
    params = [
        p
        for name, p in model.named_parameters()
        if p.grad is not None and ("q_layernorm" in name or "k_layernorm" in name)
    ]
    allreduce_gradients(params, tp_group)


def clip_grad_norm(
    params: list[torch.nn.Parameter],
    max_norm: float,
    tp_group: dist.ProcessGroup | None,
    expert_group: dist.ProcessGroup | None = None,
) -> float:
    """Global L2 norm of the gradients over all TP shards and experts; scale them down to
    ``max_norm``.

    Tensor-parallel parameters contribute their shard on every rank; replicated parameters
    (norms, row-parallel biases) are counted on TP rank 0 only. Expert-parallel parameters
    (``is_expert_parallel``) are summed over ``expert_group`` (TP x EP) instead of TP; without
    it they count as the others. ``max_norm`` <= 0 only measures.
    """
    grads = [p.grad for p in params if p.grad is not None]
    owned = [
        p
        for p in params
        if p.grad is not None and param_is_not_tensor_parallel_duplicate(p, tp_group)
    ]
    split = expert_group is not None
    sq = _squared_norm([p.grad for p in owned if not (split and is_expert_parallel(p))])
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(sq, group=tp_group)
    if split:
        expert_sq = _squared_norm([p.grad for p in owned if is_expert_parallel(p)])
        if dist.get_world_size(expert_group) > 1:
            dist.all_reduce(expert_sq, group=expert_group)
        sq = sq + expert_sq.to(sq.device)
    norm = float(sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(scale)
    return norm


def _squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The float32 sum of the squares of ``grads`` (scalar; 0 on the CPU for none)."""
    if not grads:
        return torch.zeros(())
    return torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum()
