"""Streaming granularity: the units rollouts are submitted and consumed in, the gate counted in
them, and the submission staleness each mode gives (Megatron-LM's ``--rl-submission-granularity``,
``--rl-consumption-granularity`` and ``--rl-generation-lag``).

Units: a batch (B) is ``P`` groups, a group (G) is ``G`` rollouts (R). The gate holds
``max(1, round((L + 1) x units_per_batch))`` submission units, Python's round (half to even), for
a generation lag ``L >= -1`` that may be fractional.

Release points (``generator.py`` implements them):

* B: when the trainer asks for the next batch, so B/B at an integer L is ``--rl-forced-lag L``
  exactly: batch b is submitted at version ``max(0, b - L)``.
* G: when the group is consumed, that is taken into the batch the trainer is collecting. Under the
  deterministic schedule this is the engine step at which the group's generation ends (every
  group before it in consumption order having ended), never the moment its reward arrives, so
  the step at which the next group joins the engine is a function of the schedule alone. Group
  ``u`` (``u = batch x P + index``) is then submitted at version ``max(0, (u - C) // P)`` and
  trained ``group_staleness(u, C, P)`` versions later.

Consumption is in submission order in both modes (G consumption hands the trainer each group as
soon as it and every earlier group are in, and releases its unit then; B consumption waits for
the whole batch). Megatron-LM's G consumption follows completion order, which depends on timing;
here the order is the one the schedule fixes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Granularity = Literal["R", "G", "B"]
GRANULARITIES: tuple[Granularity, ...] = ("R", "G", "B")
RANK: dict[str, int] = {"R": 0, "G": 1, "B": 2}
"""Finer units rank lower."""
MEGATRON_LM_PAIRS: tuple[tuple[str, str], ...] = (
    ("B", "B"),
    ("G", "B"),
    ("G", "G"),
    ("R", "G"),
    ("R", "B"),
)
"""(submission, consumption) pairs Megatron-LM supports."""
IMPLEMENTED_SUBMISSION: tuple[str, ...] = ("B", "G")
"""Submission units the generator implements (R: not yet, see ``pair_problems``)."""


def units_per_batch(granularity: str, groups: int, group_size: int) -> int:
    """Submission units in one batch of ``groups`` groups of ``group_size`` rollouts."""
    return {"B": 1, "G": groups, "R": groups * group_size}[granularity]


def gate_capacity(lag: float, units: int) -> int:
    """Units the gate lets be in flight at generation lag ``lag``: ``max(1, round((L+1) x u))``."""
    if lag < -1:
        raise ValueError(f"the generation lag must be >= -1, got {lag}")
    return max(1, round((lag + 1) * units))


def lag_from_inflight(max_inflight_requests: int, groups: int, group_size: int) -> float:
    """``--rl-max-inflight-requests M`` as a lag: ``M / (P x G) - 1``."""
    return max_inflight_requests / (groups * group_size) - 1


def autotuned_lag(max_requests: int, groups: int, group_size: int) -> float:
    """The lag that fills the engine: ``max(1, max_requests // G) / P - 1`` groups' worth.

    ``max_requests`` is the whole job's engine slots (``--inference-max-requests``, which is
    Megatron-LM's ``dp x max_requests``)."""
    return max(1, max_requests // group_size) / groups - 1


def group_staleness(u: int, capacity: int, groups: int) -> int:
    """Versions between the submission of group ``u`` and the step that trains it, under G
    submission with consumption in submission order and ``capacity`` groups in flight."""
    return u // groups - max(0, (u - capacity) // groups)


def staleness_bounds(capacity: int, groups: int) -> tuple[int, int]:
    """(least, most) ``group_staleness`` once the pipeline is full (group ``u >= capacity``)."""
    q, r = divmod(capacity, groups)
    return q, q + (1 if r else 0)


def pair_problems(submission: str, consumption: str, partial_rollouts: bool) -> list[str]:
    """What is wrong with a (submission, consumption) pair, each message naming the flags."""
    sub, con = "--rl-submission-granularity", "--rl-consumption-granularity"
    errors = []
    if consumption == "R":
        errors.append(
            f"{con} R is not supported (nor by Megatron-LM): GRPO's advantages need a whole "
            "group, so the trainer consumes groups (G) or batches (B)"
        )
    elif RANK[consumption] < RANK[submission]:
        errors.append(
            f"{con} {consumption} is finer than {sub} {submission}: consumption may not be finer "
            "than submission"
        )
    if submission not in IMPLEMENTED_SUBMISSION:
        errors.append(
            f"{sub} {submission} is not implemented here yet: an environment generates a whole "
            "group in one agent call, so the gate cannot yet release one rollout at a time; use "
            f"{sub} G"
        )
    if submission != "B" and not partial_rollouts:
        errors.append(
            f"{sub} {submission} needs --rl-partial-rollouts (as in Megatron-LM): a unit finer "
            "than a batch lets generation span weight updates"
        )
    return errors


@dataclass(frozen=True)
class Streaming:
    """The resolved streaming mode: units, lag and the gate's capacity."""

    submission: str
    """B or G."""
    consumption: str
    """B or G."""
    lag: float
    """The generation lag (``--rl-generation-lag``, or from ``--rl-forced-lag``,
    ``--rl-max-inflight-requests`` or the autotune)."""
    capacity: int
    """Submission units the gate lets be in flight."""
    source: str
    """Where the lag came from, for the run's header."""

    @property
    def is_batch(self) -> bool:
        """B/B: the forced-lag generator of whole batches."""
        return self.submission == "B" and self.consumption == "B"

    @property
    def name(self) -> str:
        """``G/G``, ``B/B``, ..."""
        return f"{self.submission}/{self.consumption}"
