"""The CPU tier: what the trainer runs on CPU (development, CI); it also runs on one GPU.

* Model: float32 GPT with the SDPA core attention (``model_provider.build_model``); the
  reference policy is a second one (``reference.py``). ``--bf16``: the matrix products of
  training and of the engine run in bfloat16 under ``torch.autocast`` (float32 weights,
  gradients and AdamW state; the engine's KV cache and transposed weight copies in bfloat16);
  ``--recompute-granularity full``: every layer recomputed in the backward pass
  (``megatron/rl/models/recompute.py``).
* Optimizer: torch's fused AdamW, a flattened DP gradient all-reduce and a TP-aware gradient clip
  (``megatron/trainer/optimizer.py``): megatron-core's DDP and optimizers hard-code CUDA.
* Policy (``CPUPolicy``): micro-batches run one after the other; in ``train`` each
  backpropagates its share of the global token-mean loss; with routed experts, the aux loss's
  gradient is the mean over the global batch's micro-batches (``moe_step.py``).
* Rollouts: the scheduler over ``KVCacheRowRunner``s, each with its own per-slot KV cache.
* Checkpoints: one ``torch.save`` file per tensor-parallel rank, written by data-parallel rank 0:
  ``iter_XXXXXXX/mp_rank_XX/model_optim_rng.pt`` (model, optimizer, LR schedule, RNG, flags);
  with expert parallelism one per (TP, EP) rank, ``mp_rank_XX_YYY``, written by
  expert-data-parallel rank 0.
* Expert parallelism (EP > 1): expert gradients are reduced over the expert-data-parallel group
  and the rest over DP; the ranks of an expert-parallel group run every forward (and backward)
  together (``megatron/rl/models/lockstep.py``): a rank with fewer micro-batches than another
  runs one-token padding micro-batches that add nothing to the loss or the gradients.

TP, DP and EP run over gloo; PP and the distributed optimizer are refused at argument validation.
"""

from __future__ import annotations

import ast
import contextlib
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron.rl.grpo.batch import TrainBatch
from megatron.rl.inference.backends import RunnerInputs
from megatron.rl.lora.model import (
    base_fingerprint,
    base_model,
    is_adapter_key,
    load_trainable_state_dict,
    lora_adapters,
    trainable_state_dict,
)
from megatron.rl.models.lockstep import agreed_counts, expert_lockstep_group, padding_forward
from megatron.rl.models.moe import set_aux_loss_scale
from megatron.rl.models.recompute import recompute_layers
from megatron.rl.models.routing_replay import clear_targets, configure_routing
from megatron.trainer import model_provider
from megatron.trainer.checkpointing import (
    CheckpointShards,
    LoadOptions,
    TrainState,
    write_atomic,
)
from megatron.trainer.forward import (
    ModelInputs,
    forward_outputs,
    gather_data_parallel,
    micro_topk,
    model_inputs,
    padded_rows,
    routed_forward,
    routes_cleared,
)
from megatron.trainer.initialize import ParallelContext
from megatron.trainer.lora import attach_adapters
from megatron.trainer.moe_step import (
    MoEStepStats,
    set_micro_batch_aux_loss_scale,
    with_moe_metrics,
)
from megatron.trainer.nonfinite import LossCheck
from megatron.trainer.optimizer import (
    allreduce_gradients,
    allreduce_per_head_norm_gradients,
    build_optimizer,
    clip_grad_norm,
    is_expert_parallel,
    load_optimizer_state,
)
from megatron.trainer.policy import (
    LossFunction,
    PlannedUpdate,
    Policy,
    PolicyConfig,
    TopKLogits,
    plan_updates,
    update_keys,
)
from megatron.trainer.step import (
    NamedSums,
    StepResult,
    Update,
    data_parallel_micro_batches,
    policy_logprobs,
    step_result,
)
from megatron.trainer.tiers.base import Tier, no_reference_error

PerMicro = Callable[[TrainBatch, ModelInputs], tuple[torch.Tensor, ...]]
"""(micro-batch, its model inputs) -> per-token outputs (b, t, ...) of a forward."""


class CPUTier(Tier):
    """torch AdamW, the KV-cache row runner and per-rank ``torch.save`` shards."""

    name = "cpu"

    def describe(self) -> str:
        """Tier, and the precision and activation recompute when they are not the defaults."""
        parts = ["tier: cpu"]
        if self.cfg.training.bf16:
            trained = "fp32 adapters" if self.cfg.lora.lora_rank else "fp32 weights"
            parts.append(f"bf16 autocast ({trained}, gradients and AdamW)")
        if self.cfg.training.recompute_granularity == "full":
            parts.append("recompute: full")
        return " | ".join(parts)

    def build_model(self, vocab_size, load=None):
        """Float32 GPT with the SDPA core attention on ``ctx.device``; ``load`` fills its
        weights (every tensor, so the random initialization is skipped then). With LoRA the base
        is frozen and gets its adapters (``megatron/trainer/lora.py``); its frozen linear weights
        are stored transposed for the engine's products, in bfloat16 under ``--bf16`` (the values
        autocast computes with)."""
        device = self.ctx.device
        model = model_provider.build_model(self.cfg, vocab_size, device, initialize=load is None)
        if load is not None:
            load(model)
        base_dtype = torch.bfloat16 if self.cfg.training.bf16 else None  # with LoRA: frozen
        attach_adapters(model, self.cfg, store_base=True, base_dtype=base_dtype)
        if self.cfg.training.recompute_granularity == "full":
            recompute_layers(model)
        configure_routing(model, self.cfg.model.routing_mode)  # the engine's routes: R3
        return model

    def build_reference(self, vocab_size, initialize=True):
        """The same GPT as ``build_model``."""
        return model_provider.build_model(self.cfg, vocab_size, self.ctx.device, initialize)

    def build_optimizer(self, model: torch.nn.Module) -> tuple[Any, Any]:
        """torch AdamW and the shared LR schedule."""
        return build_optimizer(model, self.cfg)

    def build_policy(self, state, config, reference=None):
        """A ``CPUPolicy``."""
        return CPUPolicy(state, config, self.ctx, reference, self.cfg.training.bf16)

    def build_step_group(self, model, config, vocab_size):
        """The tier's inference backend (``cpu``: a ``KVCacheRowRunner`` with its own per-slot KV
        cache) under a ``StepGroup``."""
        compute = torch.bfloat16 if self.cfg.training.bf16 else None  # as training
        ctx = self.ctx
        inputs = RunnerInputs(
            model, config, vocab_size, ctx.device, ctx.tp_group, ctx.tp_size, compute
        )
        return self.backend_step_group(inputs)

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
    ) -> None:
        self.state = state
        self.config = config
        self.ctx = ctx
        self.reference = reference
        self.bf16 = bf16

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
                    logprobs, entropy = policy_logprobs(
                        model, micro.data, config.vocab_size, ctx, config.packing_capacity,
                        loss_fn.needs_entropy,
                    )  # fmt: skip
                moe.record()
                out = loss_fn(micro, logprobs, entropy)  # (b, t) -> sums
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


def load_model_state(model: torch.nn.Module, payload: dict, root: Path, flag: str) -> None:
    """A shard's model tensors into ``model``: the whole state dict, or with LoRA the adapters
    (their base must be the one they were trained on: ``lora_base``); a full model's shard
    into a LoRA model (``--finetune``) loads its weights as the base, the adapters as they
    start. ``SystemExit`` naming ``flag`` and ``root`` when the tensors do not fit."""
    saved = payload["model"]
    lora_saved = any(is_adapter_key(k) for k in saved)
    lora_model = lora_adapters(model) is not None
    try:
        if lora_saved and not lora_model:
            raise ValueError(
                "the checkpoint holds LoRA adapters only (a run with --lora-rank "
                f"{payload['cfg'].get('lora_rank')}): give the same LoRA flags and its base"
            )
        if lora_model and not lora_saved:  # a full model's weights as the frozen base
            missing, unexpected = model.load_state_dict(saved, strict=False)
            if unexpected or any(not is_adapter_key(k) for k in missing):
                raise ValueError(f"missing {missing[:4]}, unexpected {unexpected[:4]}")
            return
        if lora_model and payload.get("lora_base") != base_fingerprint(model):
            raise ValueError(
                "the adapters were trained on another base model (the base weights' fingerprint "
                f"{payload.get('lora_base')} differs from this run's {base_fingerprint(model)}): "
                "give the --hf-checkpoint (or --seed and model flags) of the run that saved them"
            )
        load_trainable_state_dict(model, saved)
    except (RuntimeError, ValueError) as exc:
        raise SystemExit(f"{flag} {root}: the weights do not fit this model: {exc}") from None


class TorchShards(CheckpointShards):
    """``iter_XXXXXXX/mp_rank_XX/model_optim_rng.pt``: one file per TP rank (DP rank 0 writes);
    with expert parallelism ``mp_rank_XX_YYY`` per (TP, EP) rank (expert-DP rank 0 writes: each
    holds its EP rank's experts, the rest as every rank has it)."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx = ctx

    def path(self, directory: Path) -> Path:
        """This rank's shard file in ``directory``."""
        name = f"mp_rank_{self.ctx.tp_rank:02d}"
        if self.ctx.ep_size > 1:
            name += f"_{self.ctx.ep_rank:03d}"
        return directory / name / "model_optim_rng.pt"

    def write(self, directory: Path, iteration: int, state: TrainState, cfg: dict) -> None:
        """``torch.save`` of the model, optimizer, schedule, RNG and flags (DP rank 0)."""
        ctx = self.ctx
        if (ctx.dp_rank if ctx.ep_size == 1 else ctx.expert_dp_rank) != 0:
            return
        path = self.path(directory)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "iteration": iteration,
            "tensor_model_parallel_size": self.ctx.tp_size,
            "expert_model_parallel_size": self.ctx.ep_size,
            "model": trainable_state_dict(state.model),  # the adapters only, with LoRA
            "optimizer": state.optimizer.state_dict(),
            "scheduler": state.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": repr(random.getstate()),
            "cfg": cfg,
        }
        if lora_adapters(state.model) is not None:  # what names the base: its fingerprint
            payload["lora_base"] = base_fingerprint(state.model)
        write_atomic(path, lambda tmp: torch.save(payload, tmp))

    def read(
        self,
        directory: Path,
        state: TrainState,
        check_args: Callable[[dict], None],
        options: LoadOptions = LoadOptions(),
    ) -> None:
        """Load this rank's shard into the model and, as ``options`` say, the optimizer,
        schedule and RNG."""
        payload = self._load(directory, "--load")
        check_args(payload["cfg"])
        load_model_state(state.model, payload, directory.parent, "--load")
        if options.optimizer:
            load_optimizer_state(state.optimizer, payload["optimizer"])
            state.scheduler.load_state_dict(payload["scheduler"])
        if options.rng:
            torch.set_rng_state(payload["torch_rng"])
            random.setstate(ast.literal_eval(payload["python_rng"]))

    def read_model(self, directory: Path, model: torch.nn.Module, flag: str) -> None:
        """Load only the model weights of this rank's shard (``--ref-load``)."""
        payload = self._load(directory, flag)
        load_model_state(model, payload, directory.parent, flag)

    def _load(self, directory: Path, flag: str) -> dict:
        root, path = directory.parent, self.path(directory)
        if not path.is_file():
            raise SystemExit(f"{flag} {root}: missing {path}")
        payload = torch.load(path, map_location="cpu", weights_only=True)
        if payload["tensor_model_parallel_size"] != self.ctx.tp_size:
            raise SystemExit(
                f"{flag} {root}: saved with --tensor-model-parallel-size "
                f"{payload['tensor_model_parallel_size']}, this run uses {self.ctx.tp_size}"
            )
        saved_ep = payload.get("expert_model_parallel_size", 1)
        if saved_ep != self.ctx.ep_size:
            raise SystemExit(
                f"{flag} {root}: saved with --expert-model-parallel-size {saved_ep}, this run "
                f"uses {self.ctx.ep_size}"
            )
        return payload
