"""The CUDA tier: megatron-core all the way (see ``megatron.trainer.tiers.base``).

* Model: the same GPT as the CPU tier (``model/provider.architecture``), this rank's pipeline stage,
  with the Transformer Engine layer spec when ``transformer_engine`` imports (else megatron-core's
  local modules with the SDPA core attention; they pick Apex's fused layer norm when Apex
  imports), ``Float16Module`` for ``--bf16``, wrapped in megatron-core's
  ``DistributedDataParallel`` (float32 gradient reduction).
* Optimizer: ``get_megatron_optimizer`` (Adam with decoupled weight decay = AdamW; float32 main
  weights under ``--bf16``; ``--use-distributed-optimizer`` shards its state over DP) and the
  same LR schedule as the CPU tier.
* Policy (``cuda_policy.CUDAPolicy``): ``get_forward_backward_func()`` runs the micro-batches
  (the 1F1B pipeline schedule when PP > 1), forward only for logprobs, reference logprobs and
  top-k, with ``calculate_per_token_loss`` for ``train``: each micro-batch backpropagates its loss
  *sum* and megatron-core's ``finalize_model_grads`` divides the DP-reduced gradients by the
  global number of loss tokens, exactly the CPU tier's global token-mean loss. The loss of a
  micro-batch is the CPU tier's (``losses.GRPOLoss``), so ``--grpo-iterations``, the loss terms
  (reference KL, entropy), the IS correction and sequence packing (SDPA layer spec only) behave
  alike. The reference model is a second model of this tier's build (no DDP).
* Rollouts: the scheduler over megatron-core's ``DynamicInferenceEngine`` on the trained model
  itself (``megatron.rl.inference.megatron_core.dynamic_runner``), suspended during the train step;
  with ``--rl-inference-tensor-model-parallel-size``, on an inference copy built on its own process
  groups and refit over NCCL after every optimizer step (``generation/refit.py``).
* Checkpoints: ``cuda_checkpoint.DistShards`` (``dist_checkpointing``, torch_dist).

``--clip-grad 0`` measures the gradient norm without clipping, as on CPU.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer.module import Float16Module

from megatron.rl.inference.backends import RunnerInputs
from megatron.rl.inference.megatron_core.flash_reference import attention_backend_name
from megatron.rl.models.architecture import (
    GPTArchitecture,
    build_gpt_model,
    layer_spec,
    transformer_config,
)
from megatron.rl.models.gpt_spec import SDPASpecProvider, select_backend
from megatron.rl.models.routing_replay import configure_routing
from megatron.trainer.checkpoint.directory import CheckpointShards
from megatron.trainer.model.lora import attach_adapters
from megatron.trainer.model.provider import (
    ModelBuild,
    architecture,
    padded_vocab_size,
    parallel_overrides,
)
from megatron.trainer.tiers.base import Tier
from megatron.trainer.tiers.cuda_checkpoint import DistShards
from megatron.trainer.tiers.cuda_policy import CUDAPolicy
from megatron.trainer.train.optimizer import OptimizerSettings, build_scheduler

NO_CLIP = 1e30
"""``clip_grad`` given to megatron-core for ``--clip-grad 0``: it computes the norm only when
clipping is on, and never reaches this."""


def apex_fused_wgrad_importable() -> bool:
    """Whether Apex's fused weight-gradient accumulation kernel is importable."""
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None


def cuda_transformer_config(
    spec: ModelBuild, arch: GPTArchitecture, transformer_engine: bool, initialize: bool = True
):
    """The model config of ``arch`` with the CUDA tier's layout, precision and fusions;
    ``initialize=False``: no random init (a checkpoint load fills every tensor)."""
    dtype = torch.bfloat16 if spec.bf16 else torch.float32
    return transformer_config(
        arch,
        **parallel_overrides(spec),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        calculate_per_token_loss=True,
        perform_initialization=initialize,
        bias_dropout_fusion=True,
        gradient_accumulation_fusion=transformer_engine or apex_fused_wgrad_importable(),
        **recompute_overrides(spec),
    )


def recompute_overrides(spec: ModelBuild) -> dict:
    """megatron-core's full, uniform, one-layer recompute for ``--recompute-granularity full``."""
    if not spec.recompute:
        return {}
    return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def ddp_config(settings: OptimizerSettings) -> DistributedDataParallelConfig:
    """megatron-core's DDP config of the run: float32 gradient reduction, and its check of each
    rank's gradients before it (``--check-for-nan-in-loss-and-grad``)."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=settings.distributed,
        check_for_nan_in_grad=settings.check_finite,
    )


def optimizer_config(settings: OptimizerSettings, model_config) -> OptimizerConfig:
    """megatron-core's optimizer config of the run (``--clip-grad 0``: never clip)."""
    return OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2,
        adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad if settings.clip_grad > 0 else NO_CLIP,
        bf16=model_config.bf16,
        params_dtype=model_config.params_dtype,
        use_distributed_optimizer=settings.distributed,
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
        spec, settings = self.config.model, self.config.optimizer
        return (
            f"tier: cuda | layer spec: "
            f"{'transformer_engine' if self.transformer_engine else 'local (sdpa)'} | "
            f"{'bf16' if spec.bf16 else 'fp32'} | optimizer: megatron-core "
            f"{'distributed ' if settings.distributed else ''}adam"
            f" | pp: {spec.pipeline_parallel} | rollouts: megatron-core "
            f"DynamicInferenceEngine ({attention_backend_name()})"
        )

    # ----------------------------------------------------------------- model, optimizer

    def _stage_model(
        self, vocab_size, load=None, initialize=True, adapters=False, spec=None, groups=None
    ) -> torch.nn.Module:
        """This stage's GPT on the current CUDA device (``load`` fills its weights before it is
        cast), in bf16 if asked (``Float16Module``); ``initialize=False``: no random init;
        ``adapters``: the run's LoRA adapters, base frozen (``megatron/trainer/model/lora.py``; under
        ``--bf16`` ``Float16Module`` casts them too and the optimizer keeps float32 main copies,
        as for every trained parameter). ``spec`` (default: the run's) and ``groups`` (a
        ``ProcessGroupCollection``; default: megatron-core's parallel state) build another layout's
        model, one whole stage."""
        spec = spec or self.config.model
        arch = architecture(spec, vocab_size)
        config = cuda_transformer_config(spec, arch, self.transformer_engine, initialize)
        whole = groups is not None
        model = build_gpt_model(
            arch,
            config,
            layer_spec(arch, select_backend(cuda=True), spec.section.moe_grouped_gemm),
            pre_process=whole or parallel_state.is_pipeline_first_stage(),
            post_process=whole or parallel_state.is_pipeline_last_stage(),
            pg_collection=groups,
        )
        model.to(self.ctx.device)
        if load is not None:
            load(model)
        if adapters:
            attach_adapters(model, spec)
        if config.bf16:
            model = Float16Module(config, model)
        return model

    def build_model(self, vocab_size, load=None):
        """This stage's GPT (``_stage_model``) wrapped in DDP."""
        model = self._stage_model(vocab_size, load, initialize=load is None, adapters=True)
        config, settings = model.config, self.config.optimizer
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config(settings), module=model)
        config.no_sync_func = ddp.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        configure_routing(ddp, self.config.model.section.routing_mode)  # the engine's routes: R3
        return ddp

    def build_reference(self, vocab_size, initialize=True, load=None):
        """This stage's GPT (``_stage_model``, its own config) without DDP: forward only."""
        return self._stage_model(vocab_size, load, initialize=initialize and load is None)

    def build_optimizer(self, model: torch.nn.Module) -> tuple[Any, Any]:
        """megatron-core's Adam(W) for the DDP model and the shared LR schedule."""
        settings = self.config.optimizer
        optimizer = get_megatron_optimizer(optimizer_config(settings, model.config), [model])
        model.config.grad_scale_func = optimizer.scale_loss
        return optimizer, build_scheduler(optimizer, settings)

    # ----------------------------------------------------------------- policy

    def build_policy(self, state, config, reference=None, teacher=None):
        """A ``CUDAPolicy`` (packing refused with the Transformer Engine layer spec)."""
        return CUDAPolicy(state, config, self.ctx, reference, self.transformer_engine, teacher)

    # ----------------------------------------------------------------- rollouts

    def build_step_group(self, model, config, vocab_size, layout=None):
        """The tier's inference backend (``megatron_core``: megatron-core's dynamic engine on this
        rank's shard) under a ``StepGroup``, on the training layout or on ``layout``'s replicas
        (an inference copy: the engine's context and wrapper on the copy's process groups)."""
        tp_group, tp_size, groups = self.ctx.tp_group, self.ctx.tp_size, None
        if layout is not None:
            tp_group, tp_size, groups = layout.tp_group, layout.tp_size, layout.pg_collection
        divisible_by = self.config.model.section.make_vocab_size_divisible_by
        inputs = RunnerInputs(
            model,
            config,
            vocab_size,
            self.ctx.device,
            tp_group,
            tp_size,
            padded_vocab_size=padded_vocab_size(vocab_size, divisible_by),
            pg_collection=groups,
        )
        return self.backend_step_group(inputs, layout)

    def build_inference_copy(self, vocab_size, layout):
        """This tier's GPT at ``layout``'s TP degree (every expert of an MoE model), on its process
        groups (``_stage_model``): one whole stage, bf16 under ``--bf16`` as the trained weights
        are, frozen and uninitialized (the first refit fills it)."""
        spec = dataclasses.replace(
            self.config.model,
            tensor_parallel=layout.tp_size,
            pipeline_parallel=1,
            expert_parallel=1,
            lora=None,
        )
        model = self._stage_model(
            vocab_size, initialize=False, spec=spec, groups=layout.pg_collection
        )
        model.requires_grad_(False)
        return model.eval()

    # ----------------------------------------------------------------- checkpoints

    def checkpoint_shards(self) -> CheckpointShards:
        """``dist_checkpointing`` (torch_dist): any TP/PP/DP layout of the same model loads."""
        return DistShards(self.ctx)
