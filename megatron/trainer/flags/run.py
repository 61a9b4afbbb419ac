"""The run config: one frozen section per component, and what the parse derives once.

``RunConfig`` holds the sections (``model``, ``training``, ``grpo``, ...) and the values derived
from them and the world at start-up (data-parallel size, iterations per collection, the Hugging
Face checkpoint's config and the resolved architecture). ``flags.resolve.resolve`` builds it from
the parsed values and returns every problem, each naming its flags. Nothing writes to a
``RunConfig``: tests and tools derive a variant with ``with_flags``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from megatron.trainer.flags.distill import Distillation
from megatron.trainer.flags.evaluation import Evaluation
from megatron.trainer.flags.grpo import GRPO, term_options, term_weights
from megatron.trainer.flags.lora import LoRA
from megatron.trainer.flags.model import (
    ARCHITECTURE_FLAGS,
    Model,
    architecture_flags,
)
from megatron.trainer.flags.option import Section, dest_of, options
from megatron.trainer.flags.output import Checkpointing, Logging
from megatron.trainer.flags.rollouts import Inference, Rollouts
from megatron.trainer.flags.training import Parallelism, Training

if TYPE_CHECKING:
    from megatron.rl.models.hf import HFModelConfig

SECTIONS: tuple[tuple[str, type[Section]], ...] = (
    ("rollouts", Rollouts),
    ("training", Training),
    ("model", Model),
    ("lora", LoRA),
    ("checkpointing", Checkpointing),
    ("grpo", GRPO),
    ("distillation", Distillation),
    ("evaluation", Evaluation),
    ("inference", Inference),
    ("logging", Logging),
    ("parallelism", Parallelism),
)
"""Every section, in ``--help``'s order (what users change most first)."""


@dataclass(frozen=True)
class RunConfig:
    """Every option of a run, by section, and what the start-up derived from them."""

    rollouts: Rollouts = field(default_factory=Rollouts)
    training: Training = field(default_factory=Training)
    model: Model = field(default_factory=Model)
    lora: LoRA = field(default_factory=LoRA)
    checkpointing: Checkpointing = field(default_factory=Checkpointing)
    grpo: GRPO = field(default_factory=GRPO)
    distillation: Distillation = field(default_factory=Distillation)
    evaluation: Evaluation = field(default_factory=Evaluation)
    inference: Inference = field(default_factory=Inference)
    logging: Logging = field(default_factory=Logging)
    parallelism: Parallelism = field(default_factory=Parallelism)

    world_size: int = 1
    """Ranks that train: the job's, less ``inference_ranks``."""
    inference_ranks: int = 0
    """Ranks of their own that only generate (``--refit-mode non-collocated``: the job's last
    ``--rl-inference-tensor-model-parallel-size`` ranks); 0: every rank trains."""
    data_parallel_size: int = 1
    """Model replicas: world size / (TP x PP)."""
    iterations_per_collection: int = 1
    """Training iterations per collection: --grpo-iterations x P x G / --global-batch-size."""
    started: str = ""
    """Start time of the run (``YYYYmmdd-HHMMSS``), in the names of files it writes."""
    hf: HFModelConfig | None = None
    """``--hf-checkpoint``'s config.json, read once (None without it)."""
    architecture_flags: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """The model's architecture as option values (config.json's under --hf-checkpoint)."""
    explicit: frozenset[str] = frozenset()
    """The options (argparse dests) the command line or run file gave."""

    @property
    def rollouts_per_collection(self) -> int:
        """P x G: the rollouts of one batch."""
        return self.grpo.prompts_per_step * self.grpo.group_size

    def flat(self) -> dict[str, Any]:
        """Every option by its argparse dest (the architecture resolved), plus the derived
        scalars: what a checkpoint stores and a resume compares."""
        values: dict[str, Any] = {}
        for name, _ in SECTIONS:
            section = getattr(self, name)
            for f, _, flag in options(section):
                values[dest_of(flag)] = getattr(section, f.name)
        values.update({dest_of(flag): weight for flag, weight in self.grpo.term_weights})
        values.update(self.architecture_flags)
        values.update(
            world_size=self.world_size,
            inference_ranks=self.inference_ranks,
            data_parallel_size=self.data_parallel_size,
            iterations_per_collection=self.iterations_per_collection,
            run_started=self.started,
        )
        return values

    def with_flags(self, **values: Any) -> RunConfig:
        """A copy with options replaced by argparse dest (``seq_length=64``) or derived field
        name (``data_parallel_size=2``), without validation: for tests and tools."""
        where = locations()
        changed: dict[str, dict[str, Any]] = {}
        top: dict[str, Any] = {}
        weights = {flag: 0.0 for flag, _, _ in term_options()} | dict(self.grpo.term_weights)
        for dest, value in values.items():
            if dest in where:
                section, name = where[dest]
                changed.setdefault(section, {})[name] = _frozen(value)
            elif "--" + dest.replace("_", "-") in weights:
                weights["--" + dest.replace("_", "-")] = float(value)
            elif dest in {f.name for f in dataclasses.fields(self)}:
                top[dest] = value
            else:
                raise AttributeError(f"no option or derived value {dest!r}")
        sections = {s: replace(getattr(self, s), **kw) for s, kw in changed.items()}
        run = replace(self, **sections, **top)
        run = replace(run, grpo=replace(run.grpo, term_weights=tuple(weights.items())))
        if "architecture_flags" not in top:
            arch = architecture_flags(run.model, run.hf)
            run = replace(run, architecture_flags=MappingProxyType(arch))
        return run


def resume_options() -> list[tuple[str, str, Any]]:
    """(dest, flag, default) of every option a resumed run must keep (``resume=True``)."""
    return [
        (dest_of(flag), flag, f.default)
        for _, cls in SECTIONS
        for f, declared, flag in options(cls)
        if declared.resume
    ]


def locations() -> dict[str, tuple[str, str]]:
    """argparse dest -> (section attribute, field) of every declared option."""
    return {dest_of(flag): (name, f.name) for name, cls in SECTIONS for f, _, flag in options(cls)}


def sections_of(values: Mapping[str, Any]) -> dict[str, Section]:
    """The sections of parsed values (argparse dests, every option present)."""
    built: dict[str, Section] = {}
    for name, cls in SECTIONS:
        kwargs = {f.name: _frozen(values[dest_of(flag)]) for f, _, flag in options(cls)}
        built[name] = cls(**kwargs)
    built["grpo"] = replace(built["grpo"], term_weights=term_weights(dict(values)))
    return built


def _frozen(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


__all__ = ["ARCHITECTURE_FLAGS", "RunConfig", "SECTIONS", "locations", "term_options"]
