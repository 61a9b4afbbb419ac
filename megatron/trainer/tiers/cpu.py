"""The CPU tier: what the trainer runs on CPU (development, CI); it also runs on one GPU.

* Model: float32 GPT with the SDPA core attention (``model/provider.build_model``); the
  reference policy is a second one (``reference.py``). ``--bf16``: the matrix products of
  training and of the engine run in bfloat16 under ``torch.autocast`` (float32 weights,
  gradients and AdamW state; the engine's KV cache and transposed weight copies in bfloat16);
  ``--recompute-granularity full``: every layer recomputed in the backward pass
  (``megatron/rl/models/recompute.py``).
* Optimizer: torch's fused AdamW, a flattened DP gradient all-reduce and a TP-aware gradient clip
  (``megatron/trainer/train/optimizer.py``): megatron-core's DDP and optimizers hard-code CUDA.
* Policy (``CPUPolicy``): micro-batches run one after the other; in ``train`` each
  backpropagates its share of the global token-mean loss; with routed experts, the aux loss's
  gradient is the mean over the global batch's micro-batches (``train/moe.py``).
* Rollouts: the scheduler over ``KVCacheRowRunner``s, each with its own per-slot KV cache.
* Checkpoints (``cpu_checkpoint.TorchShards``): one ``torch.save`` file per tensor-parallel rank,
  written by data-parallel rank 0: ``iter_XXXXXXX/mp_rank_XX/model_optim_rng.pt`` (model,
  optimizer, LR schedule, RNG, flags); with expert parallelism one per (TP, EP) rank,
  ``mp_rank_XX_YYY``, written by expert-data-parallel rank 0.
* Expert parallelism (EP > 1): expert gradients are reduced over the expert-data-parallel group
  and the rest over DP; the ranks of an expert-parallel group run every forward (and backward)
  together (``megatron/rl/models/lockstep.py``): a rank with fewer micro-batches than another
  runs one-token padding micro-batches that add nothing to the loss or the gradients.

TP, DP and EP run over gloo; PP and the distributed optimizer are refused at argument validation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from megatron.rl.grpo.batch import TrainBatch
from megatron.rl.inference.backends import RunnerInputs
from megatron.rl.lora.model import base_model
from megatron.rl.models.lockstep import agreed_counts, expert_lockstep_group, padding_forward
from megatron.rl.models.moe import set_aux_loss_scale
from megatron.rl.models.recompute import recompute_layers
from megatron.rl.models.routing_replay import clear_targets, configure_routing
from megatron.trainer.checkpoint.directory import CheckpointShards, TrainState
from megatron.trainer.model import provider as model_provider
from megatron.trainer.model.lora import attach_adapters
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.runtime import allocator
from megatron.trainer.tiers.base import Tier, no_reference_error, teacher_inputs
from megatron.trainer.tiers.cpu_checkpoint import TorchShards
from megatron.trainer.train.forward import (
    ModelInputs,
    forward_outputs,
    gather_data_parallel,
    micro_topk,
    model_inputs,
    padded_rows,
    routed_forward,
    routes_cleared,
    teacher_micro_outputs,
)
from megatron.trainer.train.moe import (
    MoEStepStats,
    set_micro_batch_aux_loss_scale,
    with_moe_metrics,
)
from megatron.trainer.train.nonfinite import LossCheck
from megatron.trainer.train.optimizer import (
    allreduce_gradients,
    allreduce_per_head_norm_gradients,
    build_optimizer,
    clip_grad_norm,
    is_expert_parallel,
)
from megatron.trainer.train.policy import (
    LossFunction,
    PlannedUpdate,
    Policy,
    PolicyConfig,
    TopKLogits,
    plan_updates,
    update_keys,
)
from megatron.trainer.train.step import (
    NamedSums,
    StepResult,
    TeacherLogprobs,
    Update,
    data_parallel_micro_batches,
    policy_outputs,
    step_result,
)

PerMicro = Callable[[TrainBatch, ModelInputs], tuple[torch.Tensor, ...]]
"""(micro-batch, its model inputs) -> per-token outputs (b, t, ...) of a forward."""


def bf16_products_native() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (AVX512-BF16 or AMX: oneDNN's
    own test); without it torch emulates the products, many times slower than float32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without oneDNN: nothing to say
        return True


class CPUTier(Tier):
    """torch AdamW, the KV-cache row runner and per-rank ``torch.save`` shards."""

    name = "cpu"

    def describe(self) -> str:
        """Tier, the C allocator, and the precision and activation recompute when they are not
        the defaults."""
        parts, spec = ["tier: cpu", f"allocator {allocator.loaded()}"], self.config.model
        if spec.bf16:
            trained = "fp32 adapters" if spec.lora is not None else "fp32 weights"
            parts.append(f"bf16 autocast ({trained}, gradients and AdamW)")
            if not bf16_products_native():
                parts.append(
                    "this CPU has no bfloat16 matrix instructions (AVX512-BF16 or AMX): --bf16's "
                    "products are emulated, many times slower than float32 (drop --bf16 here)"
                )
        if spec.recompute:
            parts.append("recompute: full")
        return " | ".join(parts)

    def build_model(self, vocab_size, load=None):
        """Float32 GPT with the SDPA core attention on ``ctx.device``; ``load`` fills its
        weights (every tensor, so the random initialization is skipped then). With LoRA the base
        is frozen and gets its adapters (``megatron/trainer/model/lora.py``); its frozen linear weights
        are stored transposed for the engine's products, in bfloat16 under ``--bf16`` (the values
        autocast computes with)."""
        device, spec = self.ctx.device, self.config.model
        model = model_provider.build_model(spec, vocab_size, device, initialize=load is None)
        if load is not None:
            load(model)
        base_dtype = torch.bfloat16 if spec.bf16 else None  # with LoRA: frozen
        attach_adapters(model, spec, store_base=True, base_dtype=base_dtype)
        if spec.recompute:
            recompute_layers(model)
        configure_routing(model, spec.section.routing_mode)  # the engine's routes: R3
        return model

    def build_reference(self, vocab_size, initialize=True, load=None):
        """The same GPT as ``build_model`` (``load`` fills its weights)."""
        model = model_provider.build_model(
            self.config.model, vocab_size, self.ctx.device, initialize and load is None
        )
        if load is not None:
            load(model)
        return model

    def build_optimizer(self, model: torch.nn.Module) -> tuple[Any, Any]:
        """torch AdamW and the shared LR schedule."""
        return build_optimizer(model, self.config.optimizer)

    def build_policy(self, state, config, reference=None, teacher=None):
        """A ``CPUPolicy``."""
        return CPUPolicy(state, config, self.ctx, reference, self.config.model.bf16, teacher)

    def build_step_group(self, model, config, vocab_size, layout=None):
        """The tier's inference backend (``cpu``: a ``KVCacheRowRunner`` with its own per-slot KV
        cache) under a ``StepGroup``, on the training layout or on ``layout``'s replicas."""
        compute = torch.bfloat16 if self.config.model.bf16 else None  # as training
        ctx = self.ctx
        tp_group, tp_size = ctx.tp_group, ctx.tp_size
        if layout is not None:  # the replicas of an inference copy
            tp_group, tp_size = layout.tp_group, layout.tp_size
        inputs = RunnerInputs(model, config, vocab_size, ctx.device, tp_group, tp_size, compute)
        return self.backend_step_group(inputs, layout)

    def build_inference_copy(self, vocab_size, layout):
        """The float32 GPT of ``build_model`` at ``layout``'s TP degree (every expert of an MoE
        model), on its process groups, frozen and uninitialized (the first refit fills it)."""
        spec = dataclasses.replace(
            self.config.model, tensor_parallel=layout.tp_size, expert_parallel=1
        )
        copy = model_provider.build_model(
            spec, vocab_size, self.ctx.device, False, layout.pg_collection
        )
        copy.requires_grad_(False)
        return copy.eval()

    def checkpoint_shards(self) -> CheckpointShards:
        """Per-rank ``torch.save`` files."""
        return TorchShards(self.ctx)


class CPUPolicy(Policy):
    """The policy on this rank's model: micro-batches in a loop, one forward each."""

    def __init__(
        self,
        state: TrainState,
        config: PolicyConfig,
        ctx: ParallelContext,
        reference: torch.nn.Module | None = None,
        bf16: bool = False,
        teacher: torch.nn.Module | None = None,
    ) -> None:
        self.state = state
        self.config = config
        self.ctx = ctx
        self.reference = reference
        self.bf16 = bf16
        self.teacher = teacher

    def _precision(self) -> contextlib.AbstractContextManager:
        """bfloat16 compute on float32 weights (``--bf16``: ``torch.autocast``), else nothing.

        Without autocast's cast cache: each bfloat16 copy of a weight lives only as long as the
        backward pass needs it (with ``--recompute-granularity full``, only while its layer is
        recomputed) instead of for the whole forward and backward (135M parameters: 270 MB)."""
        device = self.ctx.device.type
        return torch.autocast(device, torch.bfloat16, enabled=self.bf16, cache_enabled=False)

    def get_logprobs(self, data, micro_batch_size=None):
        """Forward only, micro-batch by micro-batch, gathered over DP."""
        model = self.state.model
        (logprobs,) = self._forward_only(model, data, micro_batch_size, self._logprobs(model))
        return logprobs

    def get_reference_policy_logprobs(self, data, micro_batch_size=None):
        """``get_logprobs`` of the reference model."""
        if self.reference is None:
            raise no_reference_error()
        reference = self.reference
        outputs = self._logprobs(reference)
        with base_model(reference):  # a LoRA policy's own base: adapters off
            (logprobs,) = self._forward_only(reference, data, micro_batch_size, outputs)
        return logprobs

    def _teacher_forward(self, data, micro_batch_size, topk):
        """The teacher's logprobs, argmax (and top-k) from one forward per micro-batch, at
        temperature 1, gathered over DP."""
        teacher, vocab, tp = self.teacher, self.config.vocab_size, self.ctx.tp_group

        def outputs(micro: TrainBatch, inputs: ModelInputs) -> tuple[torch.Tensor, ...]:
            logits = teacher(inputs.ids, inputs.positions, inputs.mask)  # (r, s, V/tp)
            return teacher_micro_outputs(logits, micro, inputs, vocab, tp, topk)

        data = teacher_inputs(data)
        return TeacherLogprobs(*self._forward_only(teacher, data, micro_batch_size, outputs))

    def get_topk_logits(self, data, k, micro_batch_size=None):
        """Each micro-batch's vocab-parallel top-k, gathered over DP."""

        model = self.state.model

        def topk(micro: TrainBatch, inputs: ModelInputs):
            routed_forward(model, inputs)
            logits = model(inputs.ids, inputs.positions, inputs.mask)  # (r, s, V/tp)
            return micro_topk(logits, inputs, k, self.config.vocab_size, self.ctx.tp_group)

        values, indices = self._forward_only(model, data, micro_batch_size, topk)
        return TopKLogits(values, indices)

    def train(self, data, loss_fn, eval_mode=False, *, gbs=None, mbs=None, caches=None):
        """One update per global batch, its micro-batches in a loop (``_update``)."""
        mbs = self.config.micro_batch_size if mbs is None else mbs
        plan = plan_updates(data, self.ctx, gbs, mbs, caches)
        return [self._update(update, loss_fn, eval_mode) for update in plan]

    def _logprobs(self, model: torch.nn.Module) -> PerMicro:
        """The (b, t) logprobs of a micro-batch under ``model`` (``forward.forward_outputs``)."""
        config, tp = self.config, self.ctx.tp_group

        def outputs(micro: TrainBatch, inputs: ModelInputs) -> tuple[torch.Tensor]:
            return forward_outputs(model, micro, inputs, config.vocab_size, tp)[:1]

        return outputs

    def _forward_only(
        self, model: torch.nn.Module, data: TrainBatch, mbs: int | None, outputs: PerMicro
    ) -> tuple[torch.Tensor, ...]:
        """The per-token ``outputs`` of every micro-batch of this rank (no gradient), as (B, T,
        ...) tensors of the whole batch (of this rank's rows when ``data`` is its shard)."""
        mbs = self.config.micro_batch_size if mbs is None else mbs
        model.eval()
        parts = []
        micros = data_parallel_micro_batches(data, self.ctx, mbs)
        with torch.no_grad(), self._precision(), routes_cleared(model):
            for micro in micros:
                inputs = model_inputs(micro, self.ctx.device, self.config.packing_capacity)
                parts.append(outputs(micro, inputs))
            self._lockstep_padding(model, len(micros), backward=False)
        width = data.input_ids.shape[1]
        local = [padded_rows(list(p), width) for p in zip(*parts)]
        if data.is_shard:  # this rank's rows only
            return tuple(local)
        return tuple(gather_data_parallel(t, self.ctx) for t in local)

    def _update(self, update: PlannedUpdate, loss_fn: LossFunction, eval_mode: bool) -> StepResult:
        """One optimizer update over the micro-batches (or, in eval mode, only the loss)."""
        start = time.perf_counter()
        ctx, config = self.ctx, self.config
        model, optimizer, scheduler = self.state.model, self.state.optimizer, self.state.scheduler
        model.train(not eval_mode)
        if not eval_mode:
            optimizer.zero_grad(set_to_none=True)
        keys = update_keys(loss_fn)
        sums = NamedSums.zeros(keys)
        denom = max(loss_fn.normalizer(update.batch), 1)
        check = LossCheck(config.check_finite and not eval_mode, ctx.rank)
        moe = MoEStepStats(model)  # nothing for a dense model
        set_micro_batch_aux_loss_scale(model, len(update.micro_batches), ctx.dp_size, ctx.device)
        with torch.set_grad_enabled(not eval_mode), routes_cleared(model):
            for micro in update.micro_batches:
                with self._precision():  # the forward; its backward runs as autograd recorded it
                    token = policy_outputs(
                        model,
                        micro.data,
                        config.vocab_size,
                        ctx,
                        config.packing_capacity,
                        loss_fn.needs_entropy,
                        loss_fn.support_ids(micro),
                    )
                moe.record()
                out = loss_fn(micro, token.logprobs, token.entropy, token.support)  # -> sums
                check.record(out.loss_sum)
                if not eval_mode:
                    (out.loss_sum / denom).backward()
                sums = sums + NamedSums.of({"loss": out.loss_sum.detach(), **out.metric_sums}, keys)
            self._lockstep_padding(model, len(update.micro_batches), backward=not eval_mode)
        if eval_mode:
            result = Update(sums, 0.0, optimizer.param_groups[0]["lr"])
        else:
            params = [p for p in model.parameters() if p.requires_grad]
            allreduce_per_head_norm_gradients(model, ctx.tp_group)
            experts = [p for p in params if is_expert_parallel(p)]  # none at EP = 1
            allreduce_gradients([p for p in params if not is_expert_parallel(p)], ctx.dp_group)
            allreduce_gradients(experts, ctx.expert_dp_group)
            expert_group = ctx.expert_model_group if experts else None
            grad_norm = clip_grad_norm(params, config.clip_grad, ctx.tp_group, expert_group)
            check.verify(grad_norm, ctx.device)  # raises before the schedule and the update
            scheduler.step(increment=1)  # update k uses the schedule's value at k + 1
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)  # generation windows need no gradients
            result = Update(sums, grad_norm, lr)
        groups = [ctx.dp_group] if ctx.dp_size > 1 else []
        caches = [m.cache for m in update.micro_batches]
        stepped = step_result(result, loss_fn, caches, update.batch, groups, ctx.device, start)
        return with_moe_metrics(stepped, moe.metrics(ctx.dp_group, None, ctx.device))

    def _lockstep_padding(self, model: torch.nn.Module, count: int, backward: bool) -> None:
        """Run one-token padding forwards (and, with ``backward``, their backwards) until this
        rank has run as many as the most of its expert-parallel group, ``count`` its own (nothing
        without expert parallelism). Their aux loss is weighted 0 and their output by 0: no
        gradient, and the routers' statistics were read before."""
        group = expert_lockstep_group(model)
        (most,) = agreed_counts([count], group, self.ctx.device)
        if most > count:
            clear_targets(model)  # a one-token forward has no recorded routes
        if backward and most > count:
            set_aux_loss_scale(0.0, self.ctx.device)  # set again before the next update
        for _ in range(most - count):
            with self._precision():
                logits = padding_forward(model, self.ctx.device)  # (1, 1, V/tp)
            if backward:
                (logits.float().sum() * 0.0).backward()
