"""The CUDA tier: megatron-core all the way (see ``megatron.trainer.tiers.base``).

* Model: the same GPT as the CPU tier (``model_provider.architecture``), this rank's pipeline stage,
  with the Transformer Engine layer spec when ``transformer_engine`` imports (else megatron-core's
  local modules with the SDPA core attention; they pick Apex's fused layer norm when Apex
  imports), ``Float16Module`` for ``--bf16``, wrapped in megatron-core's
  ``DistributedDataParallel`` (float32 gradient reduction).
* Optimizer: ``get_megatron_optimizer`` (Adam with decoupled weight decay = AdamW; float32 main
  weights under ``--bf16``; ``--use-distributed-optimizer`` shards its state over DP) and the
  same LR schedule as the CPU tier.
* Train step: ``get_forward_backward_func()`` runs the micro-batches (the 1F1B pipeline schedule
  when PP > 1) with ``calculate_per_token_loss``: each micro-batch backpropagates its GRPO loss
  *sum* and megatron-core's ``finalize_model_grads`` divides the DP-reduced gradients by the
  global number of loss tokens, which is exactly the CPU tier's global token-mean loss. The loss
  of a micro-batch is the CPU tier's (``step.micro_batch_loss``), so ``--grpo-iterations``, the
  loss terms that need no reference policy (entropy) and the IS correction behave alike; the
  reference KL term and sequence packing are CPU-tier only for now.
* Rollouts: the scheduler over megatron-core's ``DynamicInferenceEngine`` on the trained model
  itself (``megatron.rl.inference.dynamic_runner``), suspended during the train step.
* Checkpoints: ``cuda_checkpoint.DistShards`` (``dist_checkpointing``, torch_dist).

The order of an update is the CPU tier's: the scheduler steps first (update k uses the schedule's
value at k + 1), then the optimizer. ``--clip-grad 0`` measures the gradient norm without
clipping, as on CPU.
"""

from __future__ import annotations

import functools
import importlib.util
import time
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module

from megatron.rl.grpo.batch import TrainBatch
from megatron.rl.inference.dynamic_engine import attention_backend_name, build_dynamic_step_group
from megatron.rl.inference.dynamic_runner import DynamicEngineConfig
from megatron.rl.models.architecture import (
    GPTArchitecture,
    build_gpt_model,
    layer_spec,
    transformer_config,
)
from megatron.rl.models.gpt_spec import SDPASpecProvider, select_backend
from megatron.trainer.checkpointing import CheckpointShards
from megatron.trainer.model_provider import architecture, padded_vocab_size, parallel_overrides
from megatron.trainer.optimizer import build_scheduler
from megatron.trainer.step import (
    MicroBatchCache,
    NamedSums,
    StepConfig,
    Update,
    data_parallel_micro_batches,
    micro_batch_loss,
    step_result,
    token_outputs,
)
from megatron.trainer.tiers.base import Tier
from megatron.trainer.tiers.cuda_checkpoint import DistShards

NO_CLIP = 1e30
"""``clip_grad`` given to megatron-core for ``--clip-grad 0``: it computes the norm only when
clipping is on, and never reaches this."""


def apex_fused_wgrad_importable() -> bool:
    """Whether Apex's fused weight-gradient accumulation kernel is importable."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def cuda_transformer_config(args, arch: GPTArchitecture, transformer_engine: bool):
    """The model config of ``arch`` with the CUDA tier's layout, precision and fusions."""
    dtype = torch.bfloat16 if getattr(args, "bf16", False) else torch.float32
    return transformer_config(
        arch,
        **parallel_overrides(args),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        calculate_per_token_loss=True,
        bias_dropout_fusion=True,
        gradient_accumulation_fusion=transformer_engine or apex_fused_wgrad_importable(),
    )


def optimizer_config(args, model_config) -> OptimizerConfig:
    """megatron-core's optimizer config of the flags (``--clip-grad 0``: never clip)."""
    return OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad if args.clip_grad > 0 else NO_CLIP,
        bf16=model_config.bf16,
        params_dtype=model_config.params_dtype,
        use_distributed_optimizer=getattr(args, "use_distributed_optimizer", False),
    )


class CUDATier(Tier):
    """megatron-core DDP, optimizer, pipeline schedules, dynamic engine and dist checkpoints."""

    name = "cuda"

    @property
    def transformer_engine(self) -> bool:
        """Whether the Transformer Engine layer spec is in use."""
        return not isinstance(select_backend(cuda=True), SDPASpecProvider)

    def describe(self) -> str:
        """Tier, layer spec, precision, optimizer, PP and engine attention, for the log."""
        args = self.args
        return (
            f"tier: cuda | layer spec: "
            f"{'transformer_engine' if self.transformer_engine else 'local (sdpa)'} | "
            f"{'bf16' if getattr(args, 'bf16', False) else 'fp32'} | optimizer: megatron-core "
            f"{'distributed ' if getattr(args, 'use_distributed_optimizer', False) else ''}adam"
            f" | pp: {args.pipeline_model_parallel_size} | rollouts: megatron-core "
            f"DynamicInferenceEngine ({attention_backend_name()})"
        )

    # ----------------------------------------------------------------- model, optimizer

    def build_model(self, vocab_size, load=None):
        """This stage's GPT on the current CUDA device (``load`` fills its weights before it is
        cast), in bf16 if asked, wrapped in DDP."""
        args = self.args
        arch = architecture(args, vocab_size)
        config = cuda_transformer_config(args, arch, self.transformer_engine)
        model = build_gpt_model(
            arch,
            config,
            layer_spec(arch, select_backend(cuda=True)),
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
        )
        model.to(self.ctx.device)
        if load is not None:
            load(model)
        if config.bf16:
            model = Float16Module(config, model)
        ddp = DistributedDataParallel(
            config=config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=getattr(args, "use_distributed_optimizer", False),
                check_for_nan_in_grad=True,
            ),
            module=model,
        )
        config.no_sync_func = ddp.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        return ddp

    def build_optimizer(self, model: torch.nn.Module) -> tuple[Any, Any]:
        """megatron-core's Adam(W) for the DDP model and the shared LR schedule."""
        optimizer = get_megatron_optimizer(optimizer_config(self.args, model.config), [model])
        model.config.grad_scale_func = optimizer.scale_loss
        return optimizer, build_scheduler(optimizer, self.args)

    # ----------------------------------------------------------------- train step

    def train_step(self, state, batch, config, reference=None, caches=None):
        """One update: a forward/backward over the micro-batches with megatron-core's schedule;
        pi_old, the entropy term and the IS correction as on the CPU tier.

        The reference KL term and sequence packing are not implemented here (argument validation
        refuses their flags on CUDA).
        """
        if config.needs_reference or reference is not None:
            raise NotImplementedError("the CUDA tier's train step has no reference KL term yet")
        if config.packing_capacity is not None:
            raise NotImplementedError("the CUDA tier's train step has no sequence packing yet")
        start = time.perf_counter()
        ctx = self.ctx
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        micro = data_parallel_micro_batches(batch, ctx, config.micro_batch_size, fixed_width=pp > 1)
        caches = [MicroBatchCache() for _ in micro] if caches is None else caches
        update = self._update(state, micro, caches, config)
        groups = [ctx.dp_group] if ctx.dp_size > 1 else []
        if pp > 1:  # only the last stage computed the loss
            groups.append(parallel_state.get_pipeline_model_parallel_group())
        return step_result(update, caches, batch, config, groups, ctx.device, start)

    def fill_old_logprobs(self, state, batch, config, caches):
        """pi_old of each micro-batch: megatron-core's schedule, forward only (the last pipeline
        stage computes it; earlier stages never compute a loss)."""
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        micro = data_parallel_micro_batches(
            batch, self.ctx, config.micro_batch_size, fixed_width=pp > 1
        )
        state.model.eval()
        with torch.no_grad():
            get_forward_backward_func()(
                forward_step_func=functools.partial(_logprobs_step, config=config, ctx=self.ctx),
                data_iterator=iter(list(zip(micro, caches))),
                model=[state.model],
                num_microbatches=len(micro),
                seq_length=int(micro[0].input_ids.shape[1]),
                micro_batch_size=config.micro_batch_size,
                forward_only=True,
            )

    def _update(self, state, micro, caches, config: StepConfig) -> Update:
        """One optimizer update: this rank's metric sums, the grad norm and the LR."""
        model, optimizer, scheduler = state.model, state.optimizer, state.scheduler
        model.train()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        keys = config.metric_keys()
        sums: list[NamedSums] = []  # one per micro-batch (last stage only)
        forward_step = functools.partial(_forward_step, config=config, ctx=self.ctx, sums=sums)
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(list(zip(micro, caches))),
            model=[model],
            num_microbatches=len(micro),
            seq_length=int(micro[0].input_ids.shape[1]),
            micro_batch_size=config.micro_batch_size,
            forward_only=False,
        )
        scheduler.step(increment=1)  # update k uses the schedule's value at k + 1
        lr = optimizer.param_groups[0]["lr"]
        _, grad_norm, _ = optimizer.step()
        total = NamedSums.zeros(keys)
        for micro_sums in sums:
            total = total + micro_sums
        return Update(total, float(grad_norm or 0.0), lr)

    # ----------------------------------------------------------------- rollouts

    def build_step_group(self, model, config, vocab_size):
        """megatron-core's dynamic engine on this rank's shard, as the row runner."""
        return build_dynamic_step_group(
            model,
            DynamicEngineConfig(
                max_requests=config.max_requests,
                max_seq_len=config.max_seq_len,
                eos_id=config.eos_id,
            ),
            vocab_size,
            padded_vocab_size(vocab_size, self.args.make_vocab_size_divisible_by),
            self.ctx.dp_rank,
            self.ctx.dp_size,
            self.ctx.is_replica_leader,
        )

    # ----------------------------------------------------------------- checkpoints

    def checkpoint_shards(self) -> CheckpointShards:
        """``dist_checkpointing`` (torch_dist): any TP/PP/DP layout of the same model loads."""
        return DistShards(self.ctx)


def _forward_step(data_iterator, model, *, config: StepConfig, ctx, sums: list[NamedSums]):
    """megatron-core's ``forward_step_func``: one micro-batch through this stage."""
    micro, cache = next(data_iterator)
    ids = micro.input_ids.to(ctx.device, non_blocking=True)  # (b, t); ignored past the first stage
    positions = torch.arange(ids.shape[1], device=ids.device)[None, :].expand_as(ids)
    output = model(ids, positions, None)  # last stage: (b, t, V/tp) logits; else activations
    return output, functools.partial(_loss, micro, cache, config=config, ctx=ctx, sums=sums)


def _logprobs_step(data_iterator, model, *, config: StepConfig, ctx):
    """``forward_step_func`` of ``fill_old_logprobs``: stores pi_old in the micro-batch's cache."""
    micro, cache = next(data_iterator)
    ids = micro.input_ids.to(ctx.device, non_blocking=True)  # (b, t)
    positions = torch.arange(ids.shape[1], device=ids.device)[None, :].expand_as(ids)
    output = model(ids, positions, None)

    def store(logits: torch.Tensor):
        dev = logits.device
        logprobs, _ = token_outputs(
            logits.float(), micro.target_ids.to(dev), micro.temperature.to(dev),
            config.vocab_size, ctx.tp_group, with_entropy=False,
        )  # fmt: skip
        cache.old_logprobs = logprobs.detach()
        zero = logits.new_zeros(())
        return zero, torch.ones((), dtype=torch.int, device=dev), {}

    return output, store


def _loss(
    micro: TrainBatch,
    cache: MicroBatchCache,
    logits: torch.Tensor,
    *,
    config: StepConfig,
    ctx,
    sums: list[NamedSums],
):
    """GRPO loss *sum* of a micro-batch, its loss-token count, and the metric sums."""
    dev = logits.device
    logprobs, entropy = token_outputs(
        logits.float(),  # (b, t, V/tp)
        micro.target_ids.to(dev),
        micro.temperature.to(dev),
        config.vocab_size,
        ctx.tp_group,
        config.needs_entropy,
    )
    out = micro_batch_loss(logprobs, entropy, micro, config, ctx, cache)
    sums.append(NamedSums.of(out.metric_sums(), config.metric_keys()))
    num_tokens = micro.loss_mask.sum().to(device=dev, dtype=torch.int)
    return out.loss_sum, num_tokens, {"loss_sum": out.loss_sum.detach()}
