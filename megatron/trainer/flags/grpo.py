"""The GRPO options: group shape, ratio clipping, the loss terms' weights (one flag per term,
declared by the term), the reference policy, passes per collection, dynamic sampling, the
importance-sampling correction and the sequence-level mismatch mask (``GRPOCore``); the
policy-loss variants (``flags/policy_loss.py``: the surrogate, the loss aggregation, the
rollout-IS modes, OPSM); the advantages' baseline and scale with the overlong reward shaping.
All of them are one section, ``GRPO`` (one ``--help`` group), in that order."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megatron.rl.grpo.advantages import DEFAULT_ESTIMATOR, estimators, estimators_help
from megatron.rl.grpo.names import SCALES
from megatron.trainer.flags.option import Option, Section, option
from megatron.trainer.flags.policy_loss import PolicyLossOptions, optional_float


def scale_rewards_value(text: str) -> str:
    """``--scale-rewards``' value: group, batch or none (TRL's true and false: group and none)."""
    return {"true": "group", "false": "none"}.get(text.lower(), text.lower())


@dataclass(frozen=True)
class GRPOCore(Section):
    """The groups, the clipped surrogate, passes per collection, dynamic sampling and the
    train/inference corrections: ``GRPO``'s first options."""

    prompts_per_step: int = option(
        8,
        "Groups per batch.",
        minimum=1,
        resume=True,
        common=True,
        spellings=("NeMo-RL: grpo.num_prompts_per_step",),
    )
    group_size: int = option(
        8,
        "Rollouts per prompt (>= 2).",
        resume=True,
        common=True,
        spellings=("TRL: num_generations", "NeMo-RL: grpo.num_generations_per_prompt"),
    )
    clamp_eps_lower: float = option(
        0.2,
        "Clip importance ratios below 1 - eps.",
        spellings=("TRL: epsilon", "NeMo-RL: loss_fn.ratio_clip_min"),
    )
    clamp_eps_upper: float = option(
        0.28,
        "Clip importance ratios above 1 + eps.",
        spellings=("TRL: epsilon_high", "NeMo-RL: loss_fn.ratio_clip_max"),
    )
    iterations: int = option(
        1,
        "Passes over each collection (Megatron-LM's meaning): every global batch of every pass "
        "is a training iteration (an optimizer step; the LR schedule and the policy version "
        "advance), and ratios are taken against the policy that collected, pi_old, computed "
        "before the collection's first update.",
        minimum=1,
        megatron_lm_default=2,
        spellings=("TRL: num_iterations",),
    )
    ref_load: str | None = option(
        None,
        "Checkpoint directory (as written by --save) whose model weights are the reference "
        "policy of --grpo-kl-beta; read again on every start, also when resuming.",
        flag="--ref-load",
        parse=str,
    )
    filter_groups_with_same_reward: bool = option(
        False,
        "Dynamic sampling: train only on groups whose rewards differ. Each batch is generated as "
        "--grpo-max-generation-rounds rounds of --grpo-prompts-per-step groups, all submitted "
        "together (keeping submission staleness exact); the first --grpo-prompts-per-step "
        "groups with differing rewards are trained. When fewer qualify, the batch trains on "
        "those (the others masked out of the token-mean loss) and logs how many were dropped.",
        switch=True,
        resume=True,
    )
    max_generation_rounds: int = option(
        1,
        "Rounds of --grpo-prompts-per-step groups generated per batch for "
        "--grpo-filter-groups-with-same-reward (Megatron-LM regenerates dropped groups without "
        "a bound): all submitted with the batch when --rl-forced-lag > 0; at lag 0 one more "
        "round only while the batch lacks groups whose rewards differ.",
        minimum=1,
        resume=True,
    )
    is_correction: bool = option(
        False,
        "Take the ratio against the trainer's pre-update policy and weight each token by the "
        "truncated importance weight min(pi_old / pi_inference, C) with the engine's per-token "
        "logprobs; logs the train/inference mismatch (is_* metrics).",
        flag="--rl-inference-logprobs-is-correction",
        negatable=True,
    )
    is_truncation_coef: float | None = option(
        1.0,
        "C of --rl-inference-logprobs-is-correction: importance weights above C are set to C; "
        "'none' caps nothing (Megatron-LM's default). Our default 1 only ever down-weights a token (see "
        "megatron/rl/grpo/importance.py).",
        flag="--rl-importance-sampling-truncation-coef",
        parse=optional_float,
        megatron_lm_default="none",
    )
    seq_logprob_error_threshold: float | None = option(
        None,
        "Mask out of the loss every sequence whose logprob error exceeds this (NeMo-RL's "
        "grpo.seq_logprob_error_threshold, e.g. 1.5): the mean over its generated tokens of "
        "exp(|log pi_old - log pi_inference|), with pi_old the policy before the collection's "
        "first update (one more forward pass when the step has no pi_old). The token-mean loss "
        "is normalised over the remaining tokens. Logs the error's min/mean/max before and after "
        "the mask, the masked sequences and the share of them that were rewarded "
        "(seq_mult_prob_error_*, seq_logprob_error_*). Default: no mask.",
        flag="--rl-seq-logprob-error-threshold",
        parse=optional_float,
        spellings=("NeMo-RL: grpo.seq_logprob_error_threshold",),
    )
    log_seq_logprob_error: bool = option(
        False,
        "Log the sequence-level logprob error (seq_mult_prob_error_min/mean/max, see "
        "--rl-seq-logprob-error-threshold) without masking anything.",
        flag="--rl-log-seq-logprob-error",
        switch=True,
    )


@dataclass(frozen=True)
class GRPO(PolicyLossOptions, GRPOCore):
    """The algorithm: groups, the policy loss, additive loss terms and their corrections, the
    advantages. The options, in ``--help`` order: ``GRPOCore``'s, ``PolicyLossOptions``', then
    the advantages and reward shaping (``megatron/rl/grpo/advantages/``, ``overlong.py``)."""

    title = "GRPO"
    prefix = "grpo-"

    adv_estimator: str = option(
        DEFAULT_ESTIMATOR,
        f"The advantage's baseline: {estimators_help()}; then divided as --scale-rewards says.",
        flag="--adv-estimator",
        aliases=("--advantage-estimator",),
        choices=estimators(),
        spellings=(
            "verl: algorithm.adv_estimator",
            "NeMo-RL: grpo.use_leave_one_out_baseline",
            "TRL: RLOOTrainer",
            "AReaL: actor.adv_norm.mean_leave1out",
        ),
    )
    scale_rewards: str = option(
        "group",
        "What the centered rewards are divided by (+ 1e-6): 'group', the standard deviation of "
        "the group's rewards (GRPO); 'batch', that of all the collection's rewards (Liu et al. "
        "2025, 'Tricks or Traps'); 'none', nothing (Dr. GRPO, Liu et al. 2025). TRL's true and "
        "false mean group and none.",
        flag="--scale-rewards",
        parse=scale_rewards_value,
        choices=SCALES,
        spellings=(
            "TRL: scale_rewards",
            "verl: algorithm.norm_adv_by_std_in_grpo (true: group, false: none)",
            "AReaL: actor.adv_norm.std_level",
        ),
    )
    overlong_buffer_len: int = option(
        0,
        "DAPO's soft overlong punishment (Yu et al. 2025): L_cache, the last tokens of each "
        "rollout's generation budget L_max (--rl-default-max-tokens or its environment's own "
        "max_tokens) over which a penalty falls linearly from 0 to -1 x "
        "--overlong-penalty-factor, added to the reward before the advantages (the longest model "
        "turn is measured). Logs overlong_penalty_mean, overlong_penalized_fraction and "
        "truncated_fraction. 0: off.",
        flag="--overlong-buffer-len",
        aliases=("--overlong-buffer-length", "--overlong-tokens"),
        minimum=0,
        spellings=(
            "verl: reward_model.reward_kwargs.overlong_buffer_cfg.len",
            "NeMo-RL: grpo.reward_shaping.overlong_buffer_length",
            "AReaL: actor.overlong_tokens",
        ),
    )
    overlong_penalty_factor: float = option(
        1.0,
        "The overlong penalty at the generation budget (see --overlong-buffer-len).",
        flag="--overlong-penalty-factor",
        aliases=("--overlong-buffer-penalty-factor", "--overlong-buffer-penalty"),
        minimum=0.0,
        spellings=(
            "verl: reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor",
            "NeMo-RL: grpo.reward_shaping.overlong_buffer_penalty",
            "AReaL: actor.overlong_penalty_factor",
        ),
    )
    mask_truncated_completions: bool = option(
        False,
        "Keep rollouts that a model turn's generation budget cut off (no stop token) out of the "
        "loss; their rewards still count in their group's baseline and scale. Logs "
        "truncated_fraction and truncated_masked_rollouts.",
        flag="--mask-truncated-completions",
        aliases=("--overlong-filtering",),
        switch=True,
        spellings=(
            "TRL: mask_truncated_completions",
            "NeMo-RL: grpo.overlong_filtering",
            "AReaL: actor.mask_no_eos_with_zero",
        ),
    )

    term_weights: tuple[tuple[str, float], ...] = ()
    """(flag, weight) of every loss term (``megatron/rl/grpo/terms``: each declares its flag and
    help; ``term_options`` makes them options of this section)."""

    def weight(self, flag: str) -> float:
        """The weight of the loss term of ``flag`` (0: off)."""
        return dict(self.term_weights).get(flag, 0.0)

    def problems(self) -> list[str]:
        errors = []
        if self.group_size < 2:
            errors.append(
                f"--grpo-group-size must be >= 2 (GRPO normalizes within a group), got "
                f"{self.group_size}"
            )
        if not 0 < self.clamp_eps_lower < 1:
            errors.append(f"--grpo-clamp-eps-lower must be in (0, 1), got {self.clamp_eps_lower}")
        if self.clamp_eps_upper <= 0:
            errors.append(f"--grpo-clamp-eps-upper must be > 0, got {self.clamp_eps_upper}")
        if self.max_generation_rounds > 1 and not self.filter_groups_with_same_reward:
            errors.append(
                "--grpo-max-generation-rounds > 1 needs --grpo-filter-groups-with-same-reward "
                "(extra rounds are only generated to replace groups that filter drops)"
            )
        coef = self.is_truncation_coef
        if coef != 1.0 and not self.is_correction:
            errors.append(
                "--rl-importance-sampling-truncation-coef needs "
                "--rl-inference-logprobs-is-correction"
            )
        if coef is not None and not (math.isfinite(coef) and coef > 0):
            errors.append(
                f"--rl-importance-sampling-truncation-coef must be > 0 or none, got {coef}"
            )
        threshold = self.seq_logprob_error_threshold
        if threshold is not None and not (math.isfinite(threshold) and threshold >= 1):
            errors.append(
                f"--rl-seq-logprob-error-threshold must be >= 1 (a sequence's error is >= 1, "
                f"exactly 1 where the trainer's and the engine's logprobs agree) or none, got "
                f"{threshold}"
            )
        variants = self.variant_problems(self.is_correction, coef)
        return errors + self.term_problems() + variants + self.shaping_problems()

    def term_problems(self) -> list[str]:
        """Each loss term's own check of its weight, and ``--ref-load`` without a term that
        reads the reference."""
        from megatron.rl.grpo.terms import loss_terms

        errors = []
        for term in loss_terms():
            try:
                term(self.weight(term.flag))
            except ValueError as err:
                errors.append(f"{term.flag} {err}")
        if self.ref_load is not None:
            users = [t.flag for t in loss_terms() if "ref_logprobs" in t.requires]
            if not any(self.weight(f) != 0 for f in users):
                errors.append(
                    f"--ref-load needs {' or '.join(f + ' > 0' for f in users)} (only loss terms "
                    "that use the reference policy read it)"
                )
        return errors

    def shaping_problems(self) -> list[str]:
        """The advantage and reward-shaping options against each other."""
        if self.overlong_penalty_factor != 1.0 and self.overlong_buffer_len == 0:
            return ["--overlong-penalty-factor needs --overlong-buffer-len > 0"]
        return []


def term_options() -> list[tuple[str, Option, float]]:
    """(flag, declaration, default) of each loss term's weight: one option per module of
    ``megatron/rl/grpo/terms`` (importing them loads no torch)."""
    from megatron.rl.grpo.terms import loss_terms

    return [(t.flag, Option(t.help, flag=t.flag, common=True), 0.0) for t in loss_terms()]


def term_weights(values: dict[str, Any]) -> tuple[tuple[str, float], ...]:
    """The ``term_weights`` of parsed values (``values``: argparse dests)."""
    return tuple(
        (flag, float(values[flag.lstrip("-").replace("-", "_")])) for flag, _, _ in term_options()
    )
