"""One GRPO optimizer step: micro-batches -> DP gradient all-reduce -> clip -> AdamW -> LR step."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron.rl.grpo.batch import TrainBatch
from megatron.rl.grpo.logprobs import token_logprobs
from megatron.rl.grpo.loss import GRPOLossConfig, LossInputs, LossOutput, grpo_loss
from megatron.training.initialize import ParallelContext
from megatron.training.optimizer import allreduce_gradients, clip_grad_norm


@dataclass(frozen=True)
class StepResult:
    """Global (all-reduced) results of one optimizer step."""

    loss: float
    grad_norm: float
    lr: float
    clip_fraction: float
    ratio_mean: float
    mismatch_kl: float
    loss_tokens: int
    trained_tokens: int
    seconds: float


def forward_backward_step(
    model: torch.nn.Module,
    micro_batch: TrainBatch,
    loss_config: GRPOLossConfig,
    num_global_tokens: int,
    vocab_size: int,
    ctx: ParallelContext,
) -> LossOutput:
    """Forward one micro-batch, backward its share of the token-mean loss; returns its sums."""
    dev = ctx.device
    ids = micro_batch.input_ids.to(dev)  # (b, t)
    positions = torch.arange(ids.shape[1], device=dev)[None, :].expand_as(ids)  # (b, t)
    logits = model(ids, positions, None)  # (b, t, V/tp)
    logprobs = token_logprobs(
        logits,
        micro_batch.target_ids.to(dev),
        vocab_size,
        micro_batch.temperature.to(dev),
        ctx.tp_group,
    )  # (b, t)
    out = grpo_loss(
        LossInputs(
            trainer_logprobs=logprobs,
            inference_logprobs=micro_batch.inference_logprobs.to(dev),
            advantages=micro_batch.advantages.to(dev),
            loss_mask=micro_batch.loss_mask.to(dev),
        ),
        loss_config,
    )
    (out.loss_sum / max(num_global_tokens, 1)).backward()
    return out


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: OptimizerParamScheduler,
    batch: TrainBatch,
    micro_batch_size: int,
    clip_grad: float,
    loss_config: GRPOLossConfig,
    vocab_size: int,
    ctx: ParallelContext,
) -> StepResult:
    """Train on this rank's data-parallel shard of ``batch`` (the whole global batch)."""
    start = time.perf_counter()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    per_rank = batch.num_rows // ctx.dp_size
    first = ctx.dp_rank * per_rank
    num_tokens = batch.num_loss_tokens  # global: every rank holds the whole batch
    sums = torch.zeros(4, dtype=torch.float64)  # loss, clipped, ratio, mismatch-kl
    for mb_start in range(first, first + per_rank, micro_batch_size):
        micro = batch.rows(mb_start, mb_start + micro_batch_size)
        out = forward_backward_step(model, micro, loss_config, num_tokens, vocab_size, ctx)
        parts = (out.loss_sum, out.clipped_tokens, out.ratio_sum, out.mismatch_kl_sum)
        sums += torch.stack([p.detach().double().cpu() for p in parts])
    params = [p for p in model.parameters() if p.requires_grad]
    allreduce_gradients(params, ctx.dp_group)
    grad_norm = clip_grad_norm(params, clip_grad, ctx.tp_group)
    scheduler.step(increment=1)  # update k uses the schedule's value at k + 1 (no zero-LR step)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    if ctx.dp_size > 1:
        dist.all_reduce(sums, group=ctx.dp_group)
    denom = max(num_tokens, 1)
    return StepResult(
        loss=float(sums[0]) / denom,
        grad_norm=grad_norm,
        lr=lr,
        clip_fraction=float(sums[1]) / denom,
        ratio_mean=float(sums[2]) / denom,
        mismatch_kl=float(sums[3]) / denom,
        loss_tokens=num_tokens,
        trained_tokens=int(batch.lengths.sum()),
        seconds=time.perf_counter() - start,
    )
