"""The policy-loss variants' options of the GRPO section: the surrogate (``--policy-loss``), the
loss aggregation, the rollout importance-sampling modes and off-policy sequence masking.

``PolicyLossOptions`` is mixed into ``flags.grpo.GRPO`` (one ``--help`` group, ``cfg.grpo``).
Every choice and default comes from the library's torch-free names: the variants are the modules
of ``megatron/rl/grpo/policy_loss`` (a new module is a new choice), the other modes are
``megatron/rl/grpo/names.py``'s tuples; ``tests/unit_tests/trainer/flags/test_choices.py`` checks
that the flags and the library agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron.rl.grpo.names import AGG_MODES, DEFAULT_AGG_MODE, DEFAULT_IS_MODE, IS_MODES
from megatron.rl.grpo.policy_loss import DEFAULT_POLICY_LOSS, policy_losses
from megatron.trainer.flags.option import Section, option


def optional_float(text: str) -> float | None:
    """A float, or ``none`` for no value."""
    return None if text.lower() == "none" else float(text)


@dataclass(frozen=True)
class PolicyLossOptions(Section):
    """The policy-loss variants (docs/user_guide.md "Policy-loss variants")."""

    policy_loss: str = option(
        DEFAULT_POLICY_LOSS,
        "The surrogate of the policy loss, one module each in megatron/rl/grpo/policy_loss/ "
        "(docs/user_guide.md, 'Policy-loss variants', gives each one's formula and metrics): "
        "vanilla is min(r A, clip(r, 1 - --grpo-clamp-eps-lower, 1 + --grpo-clamp-eps-upper) A) "
        "per token; gspo takes GSPO's sequence-level ratio (the paper's objective with "
        "--loss-agg-mode seq-mean-token-mean); cispo CISPO's capped stop-gradient weight.",
        flag="--policy-loss",
        choices=policy_losses(),
        spellings=(
            "TRL: importance_sampling_level=sequence (gspo), loss_type=cispo",
            "verl: actor.policy_loss.loss_mode",
            "NeMo-RL: loss_fn.sequence_level_importance_ratios (gspo), loss_fn.use_cispo",
        ),
    )
    loss_agg_mode: str = option(
        DEFAULT_AGG_MODE,
        "How the per-token losses become the global batch's loss: token-mean (every loss token "
        "weighs the same, DAPO), seq-mean-token-mean (mean over sequences of each one's token "
        "mean, the GRPO paper), seq-mean-token-sum (mean over sequences of token sums) or "
        "seq-mean-token-sum-norm (Dr. GRPO: token sums divided by the constant "
        "--loss-scale-factor, then the mean over sequences). Sequences without loss tokens do "
        "not count; the result does not depend on the micro-batch or data-parallel size.",
        flag="--loss-agg-mode",
        choices=AGG_MODES,
        spellings=(
            "TRL: loss_type (dapo: token-mean, grpo: seq-mean-token-mean, dr_grpo: "
            "seq-mean-token-sum-norm)",
            "verl: actor.loss_agg_mode",
            "NeMo-RL: loss_fn.token_level_loss",
        ),
    )
    loss_scale_factor: float | None = option(
        None,
        "The constant C of --loss-agg-mode seq-mean-token-sum-norm (Dr. GRPO's generation "
        "budget). Default: --rl-default-max-tokens.",
        flag="--loss-scale-factor",
        parse=optional_float,
        spellings=("TRL: max_completion_length (dr_grpo)", "verl: actor.loss_scale_factor"),
    )
    is_mode: str = option(
        DEFAULT_IS_MODE,
        "The weights of --rl-inference-logprobs-is-correction, from rho = pi_old / "
        "pi_inference per token or its product over the sequence: token_truncate (clip rho into "
        "[--rl-importance-sampling-clip-min, --rl-importance-sampling-truncation-coef], TIS), "
        "token_mask (weight 0 outside that range, MIS / ICE-POP), sequence_truncate, "
        "sequence_mask. Logs is_masked_fraction and is_masked_sequence_fraction in the mask "
        "modes.",
        flag="--rl-importance-sampling-mode",
        choices=IS_MODES,
        spellings=(
            "TRL: vllm_importance_sampling_mode",
            "verl: algorithm.rollout_correction.rollout_is, rollout_rs",
            "NeMo-RL: loss_fn.truncated_importance_sampling_type (tis, icepop)",
        ),
    )
    is_clip_min: float | None = option(
        None,
        "The lower bound of --rl-importance-sampling-mode's range (truncated up to it, or "
        "masked below it); 'none': no lower bound.",
        flag="--rl-importance-sampling-clip-min",
        parse=optional_float,
        spellings=(
            "TRL: vllm_importance_sampling_clip_min",
            "NeMo-RL: loss_fn.truncated_importance_sampling_ratio_min",
        ),
    )
    off_policy_mask_threshold: float | None = option(
        None,
        "Off-policy sequence masking (OPSM, DeepSeek-V3.2): take out of the policy loss every "
        "sequence with a negative advantage whose mean over its tokens of log pi_inference - "
        "log pi_theta exceeds this delta (e.g. 0.5). Logs opsm_masked_sequence_fraction. "
        "Default: no mask.",
        flag="--off-policy-mask-threshold",
        aliases=("--opsm-delta",),
        parse=optional_float,
        spellings=("TRL: off_policy_mask_threshold", "slime: --use-opsm --opsm-delta"),
    )

    def variant_problems(self, is_correction: bool, truncation_coef: float | None) -> list[str]:
        """The checks of these options, given the IS correction's switch
        (``--rl-inference-logprobs-is-correction``) and its C
        (``--rl-importance-sampling-truncation-coef``)."""
        errors = []
        factor = self.loss_scale_factor
        if factor is not None and self.loss_agg_mode != "seq-mean-token-sum-norm":
            errors.append("--loss-scale-factor needs --loss-agg-mode seq-mean-token-sum-norm")
        if factor is not None and not (math.isfinite(factor) and factor > 0):
            errors.append(f"--loss-scale-factor must be > 0, got {factor}")
        if self.is_mode != DEFAULT_IS_MODE and not is_correction:
            errors.append(
                "--rl-importance-sampling-mode needs --rl-inference-logprobs-is-correction"
            )
        low = self.is_clip_min
        if low is not None and not is_correction:
            errors.append(
                "--rl-importance-sampling-clip-min needs --rl-inference-logprobs-is-correction"
            )
        if low is not None and not (math.isfinite(low) and low >= 0):
            errors.append(f"--rl-importance-sampling-clip-min must be >= 0 or none, got {low}")
        elif low is not None and truncation_coef is not None and not low < truncation_coef:
            errors.append(
                f"--rl-importance-sampling-clip-min ({low}) must be below "
                f"--rl-importance-sampling-truncation-coef ({truncation_coef})"
            )
        if self.is_mode.startswith("sequence") and truncation_coef is None:
            errors.append(
                f"--rl-importance-sampling-mode {self.is_mode} needs "
                "--rl-importance-sampling-truncation-coef (a sequence's weight is a product of "
                "its tokens' ratios)"
            )
        delta = self.off_policy_mask_threshold
        if delta is not None and not (math.isfinite(delta) and delta >= 0):
            errors.append(f"--off-policy-mask-threshold must be >= 0 or none, got {delta}")
        return errors
