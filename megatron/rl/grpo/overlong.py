"""Overlong reward shaping (DAPO's soft overlong punishment) and the mask of truncated completions.

DAPO (Yu et al. 2025, section 3.4) adds a length penalty to the reward of a completion y of
|y| generated tokens, with L_max the generation budget and L_cache the buffer before it:

    R_length(y) = 0                                  if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                = -1                                 if L_max < |y|

scaled by a penalty factor f: the shaped reward is r + f * R_length(y), from 0 at the buffer's
start down to -f at the budget. Peers: verl ``reward_model.reward_kwargs.overlong_buffer_cfg``
(``len``, ``penalty_factor``, with ``max_resp_len``), NeMo-RL ``grpo.reward_shaping``
(``overlong_buffer_length``, ``overlong_buffer_penalty``, ``max_response_length``), AReaL
``actor.overlong_tokens`` / ``actor.overlong_penalty_factor``, TRL's reward function
``get_soft_overlong_punishment``.

Truncated completions (DAPO's "overlong filtering", TRL ``mask_truncated_completions``, NeMo-RL
``grpo.overlong_filtering``) are kept out of the loss: their tokens carry none, but their rewards
still count in their group's baseline and scale (as in TRL and NeMo-RL).

Which length and which limit. L_max is the rollout's own generation budget: the
``max_tokens`` its request was sampled with (``--rl-default-max-tokens``, or the environment's
own, e.g. ``Problem.max_tokens`` or ``agent_args.max_tokens``), recorded on the rollout
(``TokenRollout.max_tokens``). |y| is the rollout's generated tokens, EOS included when it
stopped on one; in a multi-turn rollout every model turn has that budget and the longest turn is
the one measured (``TokenRollout.turn_lengths``). A rollout is truncated when a model turn ended
at its budget rather than on a stop token (the engine's ``finish_reason == "length"``,
``TokenRollout.truncated``; under ``--rl-ignore-eos`` every rollout is). A rollout that records
none of these (built by code that predates them) is measured by its generated tokens against the
default budget, and is truncated when it reached that budget.

The environment's reward is what dynamic sampling filters on and what ``reward_mean`` logs; the
shaped reward only enters the advantages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron.rl.wire import RolloutGroup, TokenRollout


@dataclass(frozen=True)
class OverlongConfig:
    """The soft overlong penalty and the mask of truncated completions."""

    buffer_len: int
    """L_cache: the last tokens of the budget over which the penalty grows (0: no penalty)."""
    penalty_factor: float
    """f: the penalty at the budget."""
    mask_truncated: bool
    """Keep truncated completions out of the loss."""
    default_max_tokens: int
    """L_max of a rollout that does not record its budget (``--rl-default-max-tokens``)."""

    def __post_init__(self) -> None:
        if self.buffer_len < 0 or self.penalty_factor < 0 or self.default_max_tokens < 1:
            raise ValueError(
                f"need buffer_len >= 0, penalty_factor >= 0 and default_max_tokens >= 1, got "
                f"{self.buffer_len}, {self.penalty_factor}, {self.default_max_tokens}"
            )


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    """f * R_length(y) for |y| = ``length`` under budget L_max = ``max_len`` and buffer L_cache =
    ``buffer_len`` (0: no penalty): 0, then linear down to -f at the budget, -f beyond it."""
    if buffer_len <= 0:
        return 0.0
    start = max_len - buffer_len
    if length <= start:
        return 0.0
    if length <= max_len:
        return (start - length) / buffer_len * factor
    return -factor


@dataclass(frozen=True)
class CompletionLength:
    """What the shaping measures of one rollout."""

    length: int
    """|y|: generated tokens (of the longest model turn)."""
    budget: int
    """L_max: the generation budget of each model turn."""
    truncated: bool
    """A model turn ended at its budget."""


def completion_length(rollout: TokenRollout, default_max_tokens: int) -> CompletionLength:
    """|y|, L_max and truncation of ``rollout`` (see the module docstring for unrecorded ones)."""
    if rollout.turn_lengths:
        length = max(rollout.turn_lengths)
    else:
        length = sum(rollout.generation_mask)
    budget = rollout.max_tokens if rollout.max_tokens is not None else default_max_tokens
    truncated = rollout.truncated if rollout.truncated is not None else length >= budget
    return CompletionLength(length, budget, truncated)


@dataclass(frozen=True)
class ShapedRewards:
    """The rewards of a batch's rollouts, in (group, rollout) order, after shaping."""

    rewards: torch.Tensor
    """(B,) float64: the environment's reward plus the penalty (placeholders: as given)."""
    penalties: torch.Tensor
    """(B,) float64: f * R_length(y) (0 for placeholders)."""
    truncated: torch.Tensor
    """(B,) bool: truncated completions (never placeholders)."""
    masked: torch.Tensor
    """(B,) bool: the rows kept out of the loss (the truncated ones under ``mask_truncated``)."""
    valid: torch.Tensor
    """(B,) bool: the rows that are not placeholders."""
    config: OverlongConfig

    def metrics(self) -> dict[str, float]:
        """Over the valid rollouts: ``truncated_fraction`` (the share truncated); with the
        penalty, ``overlong_penalty_mean`` (the mean of f * R_length, <= 0) and
        ``overlong_penalized_fraction`` (the share with a penalty); with the mask,
        ``truncated_masked_rollouts`` (the rows kept out of the loss)."""
        n = max(int(self.valid.sum()), 1)
        found = {"truncated_fraction": int(self.truncated.sum()) / n}
        if self.config.buffer_len > 0:
            found["overlong_penalty_mean"] = float(self.penalties[self.valid].sum()) / n
            found["overlong_penalized_fraction"] = int((self.penalties < 0).sum()) / n
        if self.config.mask_truncated:
            found["truncated_masked_rollouts"] = int(self.masked.sum())
        return found


def shape_rewards(groups: list[RolloutGroup], config: OverlongConfig) -> ShapedRewards:
    """The shaped rewards and the masked rows of ``groups``' rollouts."""
    rollouts = [r for g in groups for r in g.rollouts]
    valid = torch.tensor([not r.is_placeholder for r in rollouts], dtype=torch.bool)
    penalties = torch.zeros(len(rollouts), dtype=torch.float64)
    truncated = torch.zeros(len(rollouts), dtype=torch.bool)
    for i, r in enumerate(rollouts):
        if r.is_placeholder:
            continue
        measured = completion_length(r, config.default_max_tokens)
        penalties[i] = overlong_penalty(
            measured.length, measured.budget, config.buffer_len, config.penalty_factor
        )
        truncated[i] = measured.truncated
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float64) + penalties
    masked = truncated if config.mask_truncated else torch.zeros_like(truncated)
    return ShapedRewards(rewards, penalties, truncated, masked.clone(), valid, config)
