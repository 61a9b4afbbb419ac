"""The rollout generators' types: what they submit (``RolloutConfig``), what they hand the trainer
(``RolloutBatch``) and what a checkpoint keeps of them (``PipelineState``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict

from megatron.rl.inference.engine_snapshot import EngineSnapshot
from megatron.rl.wire import RolloutGroup, SamplingParams


@dataclass(frozen=True)
class RolloutConfig:
    """What the generator submits and how far ahead."""

    forced_lag: int
    """L: batch s+L+1 is submitted when batch s has been consumed (0 = on-policy)."""
    groups_per_batch: int
    """GRPO groups (prompts) per batch."""
    group_size: int
    """Rollouts per group."""
    seed: int
    """Run seed passed to agents in every request."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Default sampling parameters of every request (agents may override max_tokens)."""
    rounds: int = 1
    """R: the batch's groups come in R rounds of ``groups_per_batch // R`` (point 5)."""
    lazy_rounds: bool = False
    """Submit a further round only while the batch lacks groups whose rewards differ (L = 0
    only); False: every round with the batch."""
    submission: str = "B"
    """Submission unit: B (whole batches through ``forced_lag + 1`` permits) or G (groups through
    ``capacity`` permits, ``group_stream.py``)."""
    consumption: str = "B"
    """Consumption unit: B (whole batches) or G (groups one by one, in order)."""
    capacity: int | None = None
    """Groups the gate lets be in flight under G submission (``granularity.gate_capacity``)."""

    def __post_init__(self) -> None:
        if (self.submission, self.consumption) not in (("B", "B"), ("G", "B"), ("G", "G")):
            raise ValueError(f"unsupported streaming mode {self.submission}/{self.consumption}")
        if self.submission == "G":
            if self.capacity is None or self.capacity < 1:
                raise ValueError("G submission needs a gate capacity >= 1 (groups)")
            if self.consumption == "B" and self.capacity < self.groups_per_batch:
                raise ValueError(
                    f"G/B needs the gate to hold a whole batch: capacity {self.capacity} < "
                    f"{self.groups_per_batch} groups"
                )
            if self.rounds != 1:
                raise ValueError("generation rounds (dynamic sampling) need B/B streaming")
        if self.forced_lag < 0:
            raise ValueError(f"forced_lag must be >= 0, got {self.forced_lag}")
        if self.groups_per_batch < 1 or self.group_size < 1:
            raise ValueError("groups_per_batch and group_size must be >= 1")
        if self.rounds < 1 or self.groups_per_batch % self.rounds:
            raise ValueError(f"{self.rounds} rounds do not divide {self.groups_per_batch} groups")
        if self.lazy_rounds and self.forced_lag != 0:
            raise ValueError("lazy rounds need forced_lag 0 (else a round is submitted late)")


class PipelineState(BaseModel):
    """The generator's state after ``drain``: what a checkpoint needs to resume the lag exactly."""

    model_config = ConfigDict(extra="forbid")

    next_batch_id: int
    """The batch the trainer asks for next (the prompt cursor: prompts derive from batch ids)."""
    submitted: int
    """Batches submitted so far; batches ``next_batch_id .. submitted - 1`` are in ``groups``."""
    forced_lag: int
    groups_per_batch: int
    group_size: int
    groups: list[RolloutGroup]
    """Every finished, unconsumed group, ordered by (batch_id, index_in_batch)."""
    batch_versions: dict[int, int] = {}
    """Policy version each unconsumed batch was submitted at."""
    engine: EngineSnapshot | None = None
    """The engine's keyed work in flight (``snapshot``); None after ``drain`` (every batch of
    ``next_batch_id .. submitted - 1`` is then complete in ``groups``)."""
    submission: str = "B"
    consumption: str = "B"
    capacity: int | None = None
    """G submission: the gate's capacity in groups."""
    submitted_groups: int | None = None
    """G submission: groups submitted so far (group u is group u % P of batch u // P)."""
    released_groups: int | None = None
    """G submission: groups whose gate unit was released (consumed)."""
    finished_groups: list[int] = []
    """G submission: groups past the released ones that finished generating."""
    group_versions: dict[int, int] = {}
    """G submission: policy version each unconsumed group was submitted at."""


@dataclass(frozen=True)
class RolloutBatch:
    """One training step's groups, in order, with the pipeline state at hand-over."""

    batch_id: int
    groups: list[RolloutGroup]
    in_flight: int
    """Batches submitted and not yet handed over, this one included (at most L+1)."""
    queue_depth: int
    """Finished groups of later batches waiting in the reassembly buffer."""
    gate_capacity: int | None = None
    """Submission units the gate lets be in flight (None: L+1 batches)."""
    gate_held: int | None = None
    """Units held at hand-over (None: ``in_flight`` batches)."""
