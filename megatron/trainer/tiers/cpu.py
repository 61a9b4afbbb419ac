"""The CPU tier: what the trainer runs on CPU (development, CI); it also runs on one GPU.

* Model: float32 GPT with the SDPA core attention (``model_provider.build_model``).
* Optimizer: torch AdamW, a flattened DP gradient all-reduce and a TP-aware gradient clip
  (``megatron/trainer/optimizer.py``): megatron-core's DDP and optimizers hard-code CUDA.
* Train step: micro-batches run one after the other, each backpropagating its share of the
  global token-mean loss (``step.micro_batch_loss``).
* Rollouts: the scheduler over ``KVCacheRowRunner``s, each with its own per-slot KV cache.
* Checkpoints: one ``torch.save`` file per tensor-parallel rank, written by data-parallel rank 0:
  ``iter_XXXXXXX/mp_rank_XX/model_optim_rng.pt`` (model, optimizer, LR schedule, RNG, flags).

TP and DP run over gloo; PP, bf16 and the distributed optimizer are refused at argument
validation.
"""

from __future__ import annotations

import ast
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megatron.rl.grpo.batch import TrainBatch
from megatron.rl.inference.kv_cache_runner import KVCacheRowRunner
from megatron.rl.inference.step_group import StepGroup
from megatron.rl.models.kv_cache import KVCache
from megatron.trainer import model_provider
from megatron.trainer.checkpointing import (
    CheckpointShards,
    LoadOptions,
    TrainState,
    write_atomic,
)
from megatron.trainer.initialize import ParallelContext
from megatron.trainer.optimizer import allreduce_gradients, build_optimizer, clip_grad_norm
from megatron.trainer.step import (
    MicroBatchCache,
    NamedSums,
    StepConfig,
    StepResult,
    Update,
    data_parallel_micro_batches,
    micro_batch_loss,
    policy_logprobs,
    step_result,
)
from megatron.trainer.tiers.base import Tier


class CPUTier(Tier):
    """torch AdamW, the KV-cache row runner and per-rank ``torch.save`` shards."""

    name = "cpu"

    def build_model(self, vocab_size, load=None):
        """Float32 GPT with the SDPA core attention on ``ctx.device``; ``load`` fills its
        weights."""
        model = model_provider.build_model(self.args, vocab_size, self.ctx.device)
        if load is not None:
            load(model)
        return model

    def build_optimizer(self, model: torch.nn.Module) -> tuple[Any, Any]:
        """torch AdamW and the shared LR schedule."""
        return build_optimizer(model, self.args)

    def train_step(self, state, batch, config, reference=None, caches=None):
        """One update over this rank's micro-batches (``train_step``)."""
        return train_step(state, batch, config, self.ctx, reference, caches)

    def fill_old_logprobs(self, state, batch, config, caches):
        """pi_old of each of this rank's micro-batches, forward only."""
        micros = data_parallel_micro_batches(batch, self.ctx, config.micro_batch_size)
        with torch.no_grad():
            for micro, cache in zip(micros, caches):
                cache.old_logprobs, _ = policy_logprobs(
                    state.model, micro, config.vocab_size, self.ctx, config.packing_capacity
                )

    def build_step_group(self, model, config, vocab_size):
        """A ``KVCacheRowRunner`` with its own per-slot KV cache under a ``StepGroup``."""
        mc = model.config
        cache = KVCache(
            num_layers=mc.num_layers,
            num_slots=config.max_requests,
            max_seq_len=config.max_seq_len,
            num_kv_heads=mc.num_query_groups // self.ctx.tp_size,
            head_dim=mc.kv_channels,
            dtype=mc.params_dtype,
            device=self.ctx.device,
        )
        runner = KVCacheRowRunner(model, cache, vocab_size, self.ctx.tp_group)
        return StepGroup(runner, self.ctx.dp_rank, self.ctx.dp_size, self.ctx.is_replica_leader)

    def checkpoint_shards(self) -> CheckpointShards:
        """Per-rank ``torch.save`` files."""
        return TorchShards(self.ctx)


def train_step(
    state: TrainState,
    batch: TrainBatch,
    config: StepConfig,
    ctx: ParallelContext,
    reference: torch.nn.Module | None = None,
    caches: list[MicroBatchCache] | None = None,
) -> StepResult:
    """One optimizer update on this rank's data-parallel shard of ``batch`` (the whole global
    batch, or this rank's shard of it with the global counts). ``caches`` (one per micro-batch
    of this rank) carry pi_old, pi_ref and the mismatch sums between iterations that reuse
    ``batch``; fresh ones by default."""
    start = time.perf_counter()
    if config.needs_reference and reference is None:
        raise ValueError("a loss term needs the reference policy, but none was given")
    micros = data_parallel_micro_batches(batch, ctx, config.micro_batch_size)
    caches = [MicroBatchCache() for _ in micros] if caches is None else caches
    update = _update(state, micros, caches, batch.global_loss_tokens, config, ctx, reference)
    groups = [ctx.dp_group] if ctx.dp_size > 1 else []
    return step_result(update, caches, batch, config, groups, ctx.device, start)


def _update(
    state: TrainState,
    micros: list[TrainBatch],
    caches: list[MicroBatchCache],
    num_tokens: int,
    config: StepConfig,
    ctx: ParallelContext,
    reference: torch.nn.Module | None,
) -> Update:
    """One optimizer update over the micro-batches: this rank's sums, the grad norm, the LR."""
    model, optimizer, scheduler = state.model, state.optimizer, state.scheduler
    model.train()
    optimizer.zero_grad(set_to_none=True)
    keys = config.metric_keys()
    sums = NamedSums.zeros(keys)
    for micro, cache in zip(micros, caches):
        logprobs, entropy = policy_logprobs(
            model, micro, config.vocab_size, ctx, config.packing_capacity, config.needs_entropy
        )  # (b, t)
        out = micro_batch_loss(logprobs, entropy, micro, config, ctx, cache, reference)
        (out.loss_sum / max(num_tokens, 1)).backward()
        sums = sums + NamedSums.of(out.metric_sums(), keys)
    params = [p for p in model.parameters() if p.requires_grad]
    allreduce_gradients(params, ctx.dp_group)
    grad_norm = clip_grad_norm(params, config.clip_grad, ctx.tp_group)
    scheduler.step(increment=1)  # update k uses the schedule's value at k + 1 (no zero-LR step)
    lr = optimizer.param_groups[0]["lr"]
    optimizer.step()
    return Update(sums, grad_norm, lr)


class TorchShards(CheckpointShards):
    """``iter_XXXXXXX/mp_rank_XX/model_optim_rng.pt``: one file per TP rank (DP rank 0 writes)."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx = ctx

    def path(self, directory: Path) -> Path:
        """This rank's shard file in ``directory``."""
        return directory / f"mp_rank_{self.ctx.tp_rank:02d}" / "model_optim_rng.pt"

    def write(self, directory: Path, iteration: int, state: TrainState, args: dict) -> None:
        """``torch.save`` of the model, optimizer, schedule, RNG and flags (DP rank 0)."""
        if self.ctx.dp_rank != 0:
            return
        path = self.path(directory)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "iteration": iteration,
            "tensor_model_parallel_size": self.ctx.tp_size,
            "model": state.model.state_dict(),
            "optimizer": state.optimizer.state_dict(),
            "scheduler": state.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": repr(random.getstate()),
            "args": args,
        }
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
        check_args(payload["args"])
        state.model.load_state_dict(payload["model"])
        if options.optimizer:
            state.optimizer.load_state_dict(payload["optimizer"])
            state.scheduler.load_state_dict(payload["scheduler"])
        if options.rng:
            torch.set_rng_state(payload["torch_rng"])
            random.setstate(ast.literal_eval(payload["python_rng"]))

    def read_model(self, directory: Path, model: torch.nn.Module, flag: str) -> None:
        """Load only the model weights of this rank's shard (``--ref-load``)."""
        payload = self._load(directory, flag)
        try:
            model.load_state_dict(payload["model"])
        except RuntimeError as exc:
            root = directory.parent
            raise SystemExit(f"{flag} {root}: the weights do not fit this model: {exc}") from None

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
        return payload
