"""The CUDA tier's ``Policy``: every forward and update runs megatron-core's schedule.

``get_forward_backward_func()`` (the 1F1B pipeline schedule when PP > 1) runs the micro-batches:
with ``forward_only`` for ``get_logprobs``, ``get_reference_policy_logprobs`` (on the frozen
reference model, a second model of the tier's build), ``get_topk_logits`` and ``train`` in eval
mode; with the backward for ``train``. Each micro-batch's model inputs are the CPU tier's
(``forward.model_inputs``: plain or packed rows, positions, the block-diagonal mask of packing);
the loss-function hook of the schedule computes the per-token outputs from the last stage's
logits: the forward-only methods keep them, ``train`` hands them to the ``LossFunction``.

* ``train``: ``calculate_per_token_loss``: each micro-batch backpropagates its loss *sum* and
  megatron-core's ``finalize_model_grads`` divides the DP-reduced gradients by the global number
  of loss tokens, the CPU tier's global token mean (by the global number of sequences with a
  per-sequence ``--loss-agg-mode``: each micro-batch reports its ``LossFunction.normalizer``). The scheduler steps first (update k uses the
  schedule's value at k + 1), then the optimizer, as on CPU. With routed experts the schedule
  also sets the aux loss's gradient weight (``MoEAuxLossAutoScaler``): per token, as the policy
  loss (the router multiplies each micro-batch's aux loss by its token count, and the gradients
  are divided by the global loss-token count), where the CPU tier averages over micro-batches.
* Results of the forward-only methods exist on the last pipeline stage; they are broadcast to the
  other stages, then gathered over data parallelism, so every rank returns the whole batch's.
* Pipeline stages exchange activations of one shape: micro-batches keep the batch's full width,
  and packed micro-batches are padded to the largest packed shape among them.
* Sequence packing needs the SDPA core attention's mask path: Transformer Engine's causal
  attention ignores ``attention_mask``, so packing with the TE layer spec is refused.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron.rl.grpo.batch import TrainBatch
from megatron.rl.grpo.packing import pack_sequences
from megatron.rl.lora.model import base_model
from megatron.trainer.checkpoint.directory import TrainState
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.tiers.base import no_reference_error, teacher_inputs
from megatron.trainer.train.forward import (
    ModelInputs,
    gather_data_parallel,
    micro_outputs,
    micro_token_outputs,
    micro_topk,
    model_inputs,
    padded_rows,
    routed_forward,
    routes_cleared,
    teacher_micro_outputs,
)
from megatron.trainer.train.moe import (
    MoEStepStats,
    set_schedule_aux_loss_weight,
    with_moe_metrics,
)
from megatron.trainer.train.nonfinite import LossCheck
from megatron.trainer.train.policy import (
    LossFunction,
    MicroBatch,
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
    step_result,
)

Consume = Callable[[Any, ModelInputs, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict]]
"""megatron-core's loss function of one micro-batch: (its key, its model inputs, the last
stage's (r, s, V/tp) logits) -> (loss, token count, reported dict)."""

PACKING_WITH_TE = (
    "--rl-use-sequence-packing is not supported with the Transformer Engine layer spec: its "
    "causal attention ignores the block-diagonal mask of packed rows (it needs PackedSeqParams)"
)


class CUDAPolicy(Policy):
    """The policy on this rank's DDP model and stage, through megatron-core's schedule."""

    def __init__(
        self,
        state: TrainState,
        config: PolicyConfig,
        ctx: ParallelContext,
        reference: torch.nn.Module | None = None,
        transformer_engine: bool = False,
        teacher: torch.nn.Module | None = None,
    ) -> None:
        if config.packing_capacity is not None and transformer_engine:
            raise ValueError(PACKING_WITH_TE)
        self.state = state
        self.config = config
        self.ctx = ctx
        self.reference = reference
        self.teacher = teacher

    @property
    def pipeline(self) -> int:
        """Pipeline-parallel size."""
        return parallel_state.get_pipeline_model_parallel_world_size()

    def get_logprobs(self, data, micro_batch_size=None):
        """Forward only through the schedule; the last stage's logprobs, broadcast and
        gathered."""
        out = self._forward_only(self.state.model, data, micro_batch_size, self._logprobs)
        return out[0]

    def get_reference_policy_logprobs(self, data, micro_batch_size=None):
        """``get_logprobs`` of the reference model (no DDP, eval mode)."""
        if self.reference is None:
            raise no_reference_error()
        with base_model(self.reference):  # a LoRA policy's own base: adapters off
            return self._forward_only(self.reference, data, micro_batch_size, self._logprobs)[0]

    def _teacher_forward(self, data, micro_batch_size, topk):
        """The teacher's logprobs, argmax (and top-k) at temperature 1 on the last stage, from
        one forward per micro-batch through the schedule (no DDP, eval mode), broadcast and
        gathered."""
        vocab, tp = self.config.vocab_size, self.ctx.tp_group

        def outputs(logits: torch.Tensor, micro: TrainBatch, inputs: ModelInputs):
            return teacher_micro_outputs(logits.float(), micro, inputs, vocab, tp, topk)

        specs = (((), torch.float32), ((), torch.int64))
        if topk is not None:
            specs += (((topk,), torch.float32), ((topk,), torch.int64))
        data = teacher_inputs(data)
        parts = self._forward_only(self.teacher, data, micro_batch_size, outputs, specs)
        return TeacherLogprobs(*parts)

    def get_topk_logits(self, data, k, micro_batch_size=None):
        """Each micro-batch's vocab-parallel top-k on the last stage, broadcast and gathered."""

        def topk(logits: torch.Tensor, micro: TrainBatch, inputs: ModelInputs):
            return micro_topk(logits, inputs, k, self.config.vocab_size, self.ctx.tp_group)

        specs = (((k,), torch.float32), ((k,), torch.int64))
        values, indices = self._forward_only(self.state.model, data, micro_batch_size, topk, specs)
        return TopKLogits(values, indices)

    def train(self, data, loss_fn, eval_mode=False, *, gbs=None, mbs=None, caches=None):
        """One update per global batch through the schedule (``_update``)."""
        mbs = self.config.micro_batch_size if mbs is None else mbs
        plan = plan_updates(data, self.ctx, gbs, mbs, caches, fixed_width=self.pipeline > 1)
        return [self._update(update, loss_fn, eval_mode, mbs) for update in plan]

    # ----------------------------------------------------------------- forward only

    def _logprobs(self, logits: torch.Tensor, micro: TrainBatch, inputs: ModelInputs):
        config, tp = self.config, self.ctx.tp_group
        return micro_outputs(logits.float(), micro, inputs, config.vocab_size, tp)[:1]

    def _forward_only(
        self,
        model: torch.nn.Module,
        data: TrainBatch,
        mbs: int | None,
        outputs: Callable[[torch.Tensor, TrainBatch, ModelInputs], tuple[torch.Tensor, ...]],
        specs: tuple[tuple[tuple[int, ...], torch.dtype], ...] = (((), torch.float32),),
    ) -> tuple[torch.Tensor, ...]:
        """The per-token ``outputs`` of every micro-batch of this rank as (B, T, ...) tensors of
        the whole batch (of this rank's rows when ``data`` is its shard); ``specs``: the trailing shape and dtype of each output.
        """
        mbs = self.config.micro_batch_size if mbs is None else mbs
        micros = data_parallel_micro_batches(data, self.ctx, mbs, fixed_width=self.pipeline > 1)
        parts: list[tuple[torch.Tensor, ...]] = []

        def keep(micro: TrainBatch, inputs: ModelInputs, logits: torch.Tensor):
            parts.append(outputs(logits, micro, inputs))
            one = torch.ones((), dtype=torch.int, device=logits.device)
            return logits.new_zeros(()), one, {}

        model.eval()
        with torch.no_grad():
            self._schedule(model, [(m, m) for m in micros], keep, mbs, forward_only=True)
        width = data.input_ids.shape[1]
        rows = data.num_rows if data.is_shard else data.num_rows // self.ctx.dp_size
        if parallel_state.is_pipeline_last_stage():
            local = [padded_rows(list(p), width) for p in zip(*parts)]
        else:
            local = [torch.empty((rows, width, *shape), dtype=dtype) for shape, dtype in specs]
        if self.pipeline > 1:
            local = [self._from_last_stage(t) for t in local]
        if data.is_shard:  # this rank's rows only
            return tuple(local)
        return tuple(gather_data_parallel(t, self.ctx) for t in local)

    def _from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` of the last pipeline stage on every stage (collective over the PP group)."""
        tensor = tensor.to(self.ctx.device).contiguous()
        src = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast(tensor, src, group=parallel_state.get_pipeline_model_parallel_group())
        return tensor

    # ----------------------------------------------------------------- train

    def _update(
        self, update: PlannedUpdate, loss_fn: LossFunction, eval_mode: bool, mbs: int
    ) -> StepResult:
        """One update (or, in eval mode, only the loss): this rank's sums, grad norm and LR."""
        start = time.perf_counter()
        ctx, config = self.ctx, self.config
        model, optimizer, scheduler = self.state.model, self.state.optimizer, self.state.scheduler
        keys = update_keys(loss_fn)
        sums: list[NamedSums] = []  # one per micro-batch (last stage only)
        check = LossCheck(config.check_finite and not eval_mode, ctx.rank)
        moe = MoEStepStats(model)  # nothing for a dense model

        def loss(micro: MicroBatch, inputs: ModelInputs, logits: torch.Tensor):
            """The loss *sum* of a micro-batch, its token count, and its metric sums."""
            token = micro_token_outputs(
                logits.float(),
                micro.data,
                inputs,
                config.vocab_size,
                ctx.tp_group,
                loss_fn.needs_entropy,
                loss_fn.support_ids(micro),
            )
            out = loss_fn(micro, token.logprobs, token.entropy, token.support)
            check.record(out.loss_sum)
            sums.append(NamedSums.of({"loss": out.loss_sum.detach(), **out.metric_sums}, keys))
            tokens = torch.tensor(loss_fn.normalizer(micro.data), dtype=torch.int)
            return out.loss_sum, tokens.to(logits.device), {"loss_sum": out.loss_sum.detach()}

        model.train(not eval_mode)
        if not eval_mode:
            model.zero_grad_buffer()
            optimizer.zero_grad()
        items = [(m.data, m) for m in update.micro_batches]
        normalizer = sum(loss_fn.normalizer(m.data) for m in update.micro_batches)
        set_schedule_aux_loss_weight(model, normalizer, len(items), ctx)
        try:
            with torch.set_grad_enabled(not eval_mode):
                self._schedule(model, items, loss, mbs, eval_mode, moe.record)
        except RuntimeError as exc:  # megatron-core's gradient check, on this rank alone
            error = check.megatron_core_error(exc)
            if error is None:
                raise
            raise error from None
        check.verify(None, ctx.device)  # the losses, before the update (gradients: above)
        total = NamedSums.zeros(keys)
        for micro_sums in sums:
            total = total + micro_sums
        if eval_mode:
            result = Update(total, 0.0, optimizer.param_groups[0]["lr"])
        else:
            scheduler.step(increment=1)  # update k uses the schedule's value at k + 1
            lr = optimizer.param_groups[0]["lr"]
            _, grad_norm, _ = optimizer.step()
            result = Update(total, float(grad_norm or 0.0), lr)
        groups = [ctx.dp_group] if ctx.dp_size > 1 else []
        if self.pipeline > 1:  # only the last stage computed the loss
            groups.append(parallel_state.get_pipeline_model_parallel_group())
        caches = [m.cache for m in update.micro_batches]
        stepped = step_result(result, loss_fn, caches, update.batch, groups, ctx.device, start)
        stages = parallel_state.get_pipeline_model_parallel_group() if self.pipeline > 1 else None
        return with_moe_metrics(stepped, moe.metrics(ctx.dp_group, stages, ctx.device))

    # ----------------------------------------------------------------- the schedule

    def _schedule(
        self,
        model: torch.nn.Module,
        items: list[tuple[TrainBatch, Any]],
        consume: Consume,
        mbs: int,
        forward_only: bool,
        after_forward: Callable[[], None] | None = None,
    ) -> None:
        """Run megatron-core's schedule over ``items`` ((micro-batch, key) pairs): each
        micro-batch forward through this stage, then ``after_forward()``, and
        ``consume(key, inputs, logits)`` on the last."""
        ctx, capacity = self.ctx, self.config.packing_capacity
        micros = [micro for micro, _ in items]
        rows, seq_length, packed = mbs, int(micros[0].input_ids.shape[1]), None
        if self.pipeline > 1:
            if capacity is not None:  # one packed shape for every micro-batch
                layouts = [pack_sequences(m.lengths, capacity) for m in micros]
                packed = (max(x.num_rows for x in layouts), max(x.width for x in layouts))
                rows, seq_length = packed
            elif any(m.num_rows != mbs for m in micros):
                raise ValueError(
                    f"with pipeline parallelism each data-parallel rank's rows must be a "
                    f"multiple of the micro-batch size ({mbs})"
                )

        def forward_step(data_iterator, stage: torch.nn.Module):
            micro, key = next(data_iterator)
            inputs = model_inputs(micro, ctx.device, capacity, packed)
            routed_forward(stage, inputs)
            output = stage(inputs.ids, inputs.positions, inputs.mask)  # last stage: logits
            if after_forward is not None:
                after_forward()
            return output, functools.partial(consume, key, inputs)

        with routes_cleared(model):
            get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(items),
                model=[model],
                num_microbatches=len(items),
                seq_length=seq_length,
                micro_batch_size=rows,
                forward_only=forward_only,
            )
