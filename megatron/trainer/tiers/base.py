"""What the training loop builds that differs between CPU and CUDA: the ``Tier`` interface.

Everything device-specific goes through a ``Tier``: the model (and the reference model), the
optimizer and LR schedule, the ``Policy`` the training loop trains and queries
(``megatron/trainer/train/policy.py``), the engine's step group and the inference engine, and the
checkpoint shards. Above the tier (rollout generator, agents, GRPO math, logging, servers) there
is one code path, and the parts of a train step that do not depend on the device live in
``megatron/trainer/train/step.py`` and ``forward.py``.

* ``CPUTier`` (``cpu.py``; development, CI): float32 GPT with the SDPA core attention, torch AdamW
  with a flattened DP all-reduce, ``CPUPolicy`` (micro-batches in a loop), the KV-cache row
  runner, per-rank ``torch.save`` shards.
* ``CUDATier`` (``cuda.py``; production): megatron-core DDP and ``get_megatron_optimizer``,
  ``CUDAPolicy`` (``cuda_policy.py``: ``get_forward_backward_func()``, PP), ``--bf16``, the
  Transformer Engine layer spec when it imports, megatron-core's ``DynamicInferenceEngine`` as the
  row runner, ``dist_checkpointing`` shards.

Both tiers run the same scheduler (``ContinuousBatchingScheduler``) and the same checkpoint
directory protocol (``megatron/trainer/checkpoint/directory.py``). ``megatron.trainer.tiers.select_tier``
is the only place that looks at the device. A tier reads the run through its ``TierConfig``
(built from the run config by ``config.tier_config``), never the run config itself.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from megatron.rl.grpo.batch import TrainBatch
from megatron.rl.inference.backends import InferenceBackend, RunnerInputs, default_backend
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.inference.step_group import StepGroup
from megatron.trainer.checkpoint.directory import CheckpointShards, TrainState
from megatron.trainer.model.provider import ModelBuild
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.train.optimizer import OptimizerSettings
from megatron.trainer.train.policy import Policy, PolicyConfig

if TYPE_CHECKING:
    from megatron.rl.models.hf import HFModelConfig
    from megatron.rl.refit.layout import InferenceLayout


@dataclass(frozen=True)
class TeacherSource:
    """Where the teacher's weights come from (``config.teacher_source``; built by ``teacher.py``)."""

    directory: str
    """The ``--distill-teacher`` directory, or the URL of a server that scores
    (``train/remote_teacher.py``)."""
    hf: HFModelConfig | None = None
    """Its ``config.json`` when it is a Hugging Face directory; None: a checkpoint directory of
    ours (the policy's architecture) or a server."""
    api_key: str | None = None
    """A server's bearer key (``--rl-api-key-file``, else ``MEGATRON_RL_API_KEY``)."""


@dataclass(frozen=True)
class TierConfig:
    """What a tier reads of the run (``config.tier_config``)."""

    model: ModelBuild
    """The model, its precision, recompute, LoRA adapters and parallel layout."""
    optimizer: OptimizerSettings
    """The optimizer and the LR schedule."""
    ref_load: str | None = None
    """``--ref-load``: the checkpoints the reference model's weights come from (None: the
    policy's initial weights; ``reference.py``)."""
    teacher: TeacherSource | None = None
    """``--distill-teacher``: where the distillation teacher's weights come from (None: no
    teacher; ``teacher.py``)."""


def teacher_inputs(data: TrainBatch) -> TrainBatch:
    """``data`` at temperature 1: the teacher's own distribution scores the sampled tokens."""
    return dataclasses.replace(data, temperature=torch.ones_like(data.temperature))


def no_reference_error() -> ValueError:
    """What asking a policy without a reference model for reference logprobs raises."""
    return ValueError(
        "the policy has no reference model: it is built only when a loss term needs it "
        "(--grpo-kl-beta > 0)"
    )


class Tier(ABC):
    """What the training loop builds, for one device kind. One instance per process."""

    name: ClassVar[str]
    """Short name for logs ("cpu", "cuda")."""

    def __init__(self, config: TierConfig, ctx: ParallelContext) -> None:
        self.config = config
        self.ctx = ctx

    @abstractmethod
    def build_model(
        self, vocab_size: int, load: Callable[[torch.nn.Module], None] | None = None
    ) -> torch.nn.Module:
        """This rank's model (its TP shard and, on CUDA, its pipeline stage) for a tokenizer of
        ``vocab_size`` ids, trained and used for rollouts. ``load`` fills the bare
        ``GPTModel``'s weights (a Hugging Face checkpoint) before any wrapping."""

    @abstractmethod
    def build_reference(
        self,
        vocab_size: int,
        initialize: bool = True,
        load: Callable[[torch.nn.Module], None] | None = None,
    ) -> torch.nn.Module:
        """A second model of ``build_model``'s architecture on this rank (its shard and stage),
        for forward passes only (no DDP); ``reference.py`` and ``teacher.py`` set its weights
        and freeze it. ``initialize=False`` skips the random initialization (for a caller that
        overwrites every tensor: its values are then uninitialized memory); ``load`` fills the
        bare ``GPTModel``'s weights (a Hugging Face checkpoint) before any cast."""

    @abstractmethod
    def build_optimizer(self, model: torch.nn.Module) -> tuple[Any, Any]:
        """The optimizer and the LR scheduler (megatron-core's ``OptimizerParamScheduler``)."""

    @abstractmethod
    def build_policy(
        self,
        state: TrainState,
        config: PolicyConfig,
        reference: torch.nn.Module | None = None,
        teacher: torch.nn.Module | None = None,
    ) -> Policy:
        """The ``Policy`` over ``state`` (model, optimizer, LR schedule), the frozen
        ``reference`` model (None: no reference logprobs) and the frozen distillation
        ``teacher`` (None: no teacher logprobs)."""

    @abstractmethod
    def build_step_group(
        self,
        model: torch.nn.Module,
        config: SchedulerConfig,
        vocab_size: int,
        layout: InferenceLayout | None = None,
    ) -> StepGroup:
        """The engine-step executor of this rank (every rank; collective inside a replica);
        ``layout``: the inference copy's replicas that ``model`` is laid out for (None: the
        training layout)."""

    def build_inference_copy(self, vocab_size: int, layout: InferenceLayout) -> torch.nn.Module:
        """This rank's shard of a forward-only copy of ``build_model``'s architecture laid out
        for ``layout`` (collocated refit: ``--rl-inference-tensor-model-parallel-size``), its
        weights uninitialized until the first refit."""
        raise ValueError(
            f"--rl-inference-tensor-model-parallel-size: the {self.name} tier generates on the "
            "trained model's own layout (drop the flag)"
        )

    @abstractmethod
    def checkpoint_shards(self) -> CheckpointShards:
        """How this tier writes and reads its checkpoint shards."""

    def inference_backend(self) -> InferenceBackend:
        """The inference backend whose row runner this tier's step group runs: the tier's default
        (``megatron.rl.inference.backends.DEFAULT_BACKEND``)."""
        return default_backend(self.name)

    def backend_step_group(
        self, inputs: RunnerInputs, layout: InferenceLayout | None = None
    ) -> StepGroup:
        """This rank's row runner of ``inference_backend`` under a ``StepGroup`` of the training
        layout's replicas, or of ``layout``'s."""
        runner = self.inference_backend().build(inputs)
        if layout is not None:
            return StepGroup(runner, layout.dp_rank, layout.dp_size, layout.is_replica_leader)
        return StepGroup(runner, self.ctx.dp_rank, self.ctx.dp_size, self.ctx.is_replica_leader)

    def build_engine(
        self, steps: StepGroup, config: SchedulerConfig, policy_version: Callable[[], int]
    ) -> ContinuousBatchingScheduler:
        """The inference engine over ``steps`` (global rank 0 only): the same scheduler on every
        tier; the tiers differ in their row runners."""
        return ContinuousBatchingScheduler(steps, config, policy_version)

    def describe(self) -> str:
        """One log line saying what runs."""
        return f"tier: {self.name}"
