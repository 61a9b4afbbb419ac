"""The two execution tiers behind one interface, chosen once by the device.

Everything the training loop builds that differs between CPU and CUDA goes through a ``Tier``:
the model, the optimizer and LR schedule, the train step, the engine's step executor and the
engine, and checkpoints. Above the tier (rollout generator, agents, GRPO math, logging, servers)
there is one code path. See DESIGN.md, "Where megatron-core runs, and the two tiers".

* ``CPUTier`` (development, CI): float32 GPT with the SDPA core attention, torch AdamW with a
  flattened DP all-reduce, the local continuous-batching engine with its own KV cache, per-rank
  ``torch.save`` checkpoints. TP and DP over gloo; PP, bf16 and the distributed optimizer are
  refused at argument validation.
* ``CUDATier`` (production, ``megatron.training.cuda_tier``): megatron-core DDP and
  ``get_megatron_optimizer`` (``--use-distributed-optimizer``), ``get_forward_backward_func()``
  (PP), ``--bf16``, the Transformer Engine layer spec when it imports, megatron-core's
  ``DynamicInferenceEngine`` for rollouts, ``dist_checkpointing``.

``select_tier(args, ctx)`` is the only place that looks at the device.
"""

from __future__ import annotations

import argparse
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from megatron.rl.grpo.batch import TrainBatch
from megatron.rl.grpo.loss import GRPOLossConfig
from megatron.rl.inference.engine import LocalEngineConfig, LocalInferenceEngine
from megatron.rl.inference.model_runner import ModelRunner
from megatron.rl.inference.protocol import InferenceEngine
from megatron.rl.inference.step_group import StepGroup
from megatron.rl.models.kv_cache import KVCache
from megatron.rl.rollout.generator import PipelineState
from megatron.training import checkpointing, model_provider
from megatron.training import optimizer as cpu_optimizer
from megatron.training import train_step
from megatron.training.checkpointing import Checkpoint
from megatron.training.initialize import ParallelContext
from megatron.training.train_step import StepResult


class Tier(ABC):
    """What the training loop builds, for one device kind. One instance per process."""

    name: ClassVar[str]
    """Short name for logs ("cpu", "cuda")."""

    def __init__(self, args: argparse.Namespace, ctx: ParallelContext) -> None:
        self.args = args
        self.ctx = ctx

    @abstractmethod
    def build_model(self, vocab_size: int) -> torch.nn.Module:
        """This rank's model (its TP shard and, on CUDA, its pipeline stage), trained and used
        for rollouts."""

    @abstractmethod
    def build_optimizer(self, model: torch.nn.Module) -> tuple[Any, Any]:
        """The optimizer and the LR scheduler (megatron-core's ``OptimizerParamScheduler``)."""

    @abstractmethod
    def train_step(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        scheduler: Any,
        batch: TrainBatch,
        loss_config: GRPOLossConfig,
        vocab_size: int,
        options: Any = None,
    ) -> StepResult:
        """One GRPO step on this rank's data-parallel shard of ``batch`` (collective).

        ``options`` is ``train_step.StepOptions`` (None: the defaults, one plain update).
        """

    @abstractmethod
    def build_step_group(
        self, model: torch.nn.Module, engine_config: LocalEngineConfig, vocab_size: int
    ) -> StepGroup:
        """The engine-step executor of this rank (every rank; collective inside a replica)."""

    @abstractmethod
    def build_engine(
        self,
        steps: StepGroup,
        engine_config: LocalEngineConfig,
        policy_version: Callable[[], int],
    ) -> InferenceEngine:
        """The inference engine over ``steps`` (global rank 0 only)."""

    @abstractmethod
    def save_checkpoint(
        self,
        root: str,
        iteration: int,
        model: torch.nn.Module,
        optimizer: Any,
        scheduler: Any,
        pipeline: PipelineState | None,
    ) -> None:
        """Write the state after ``iteration`` steps under ``root`` (``--save``; collective)."""

    @abstractmethod
    def load_checkpoint(
        self, root: str, model: torch.nn.Module, optimizer: Any, scheduler: Any
    ) -> Checkpoint:
        """Restore the latest checkpoint under ``root`` (``--load``; collective)."""

    def describe(self) -> str:
        """One log line saying what runs."""
        return f"tier: {self.name}"


class CPUTier(Tier):
    """The development tier: what the trainer has always run on CPU (also runs on one GPU)."""

    name = "cpu"

    def build_model(self, vocab_size: int) -> torch.nn.Module:
        """Float32 GPT with the SDPA core attention on ``ctx.device``."""
        return model_provider.build_model(self.args, vocab_size, self.ctx.device)

    def build_optimizer(self, model: torch.nn.Module) -> tuple[Any, Any]:
        """torch AdamW and the shared LR schedule."""
        return cpu_optimizer.build_optimizer(model, self.args)

    def train_step(self, model, optimizer, scheduler, batch, loss_config, vocab_size, options=None):
        """Micro-batches, flattened DP all-reduce, clipping, AdamW (``train_step.train_step``)."""
        return train_step.train_step(
            model,
            optimizer,
            scheduler,
            batch,
            micro_batch_size=self.args.micro_batch_size,
            clip_grad=self.args.clip_grad,
            loss_config=loss_config,
            vocab_size=vocab_size,
            ctx=self.ctx,
            options=train_step.StepOptions() if options is None else options,
        )

    def build_step_group(self, model, engine_config, vocab_size):
        """A ``ModelRunner`` with its own per-slot KV cache under a ``StepGroup``."""
        config = model.config
        cache = KVCache(
            num_layers=config.num_layers,
            num_slots=engine_config.max_requests,
            max_seq_len=engine_config.max_seq_len,
            num_kv_heads=config.num_query_groups // self.ctx.tp_size,
            head_dim=config.kv_channels,
            dtype=config.params_dtype,
            device=self.ctx.device,
        )
        runner = ModelRunner(model, cache, vocab_size, self.ctx.tp_group)
        return StepGroup(runner, self.ctx.dp_rank, self.ctx.dp_size, self.ctx.is_replica_leader)

    def build_engine(self, steps, engine_config, policy_version):
        """The local continuous-batching engine."""
        return LocalInferenceEngine(steps, engine_config, policy_version)

    def save_checkpoint(self, root, iteration, model, optimizer, scheduler, pipeline):
        """Per-rank ``torch.save`` (``megatron.training.checkpointing``)."""
        checkpointing.save_checkpoint(
            root, iteration, model, optimizer, scheduler, pipeline, self.args, self.ctx
        )

    def load_checkpoint(self, root, model, optimizer, scheduler):
        """Per-rank ``torch.load`` (``megatron.training.checkpointing``)."""
        return checkpointing.load_checkpoint(root, model, optimizer, scheduler, self.args, self.ctx)


def tier_class(device: torch.device) -> type[Tier]:
    """The tier of a device: ``CUDATier`` for a CUDA device, ``CPUTier`` otherwise."""
    if device.type == "cuda":
        from megatron.training.cuda_tier import CUDATier

        return CUDATier
    return CPUTier


def select_tier(args: argparse.Namespace, ctx: ParallelContext) -> Tier:
    """The tier this process runs (by ``ctx.device``, set by ``initialize_distributed``)."""
    return tier_class(ctx.device)(args, ctx)
