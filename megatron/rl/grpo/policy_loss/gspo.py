"""GSPO: the sequence-level importance ratio (Zheng et al. 2025, "Group Sequence Policy
Optimization", arXiv 2507.18071).

Per sequence i with loss tokens t (m_it = 1, n_i of them) and pi_old the ratio's denominator (the
engine's logprobs, or the trainer's pre-update policy with ``--grpo-iterations`` > 1 or the IS
correction):

    s_i = exp( (1/n_i) sum_t m_it log(pi_theta(y_it) / pi_old(y_it)) )

the geometric mean of the token ratios, clipped at the sequence level with the usual range:

    objective_it = min( s_it A_i, clip(s_it, 1 - eps_lower, 1 + eps_upper) A_i )
    s_it = sg(s_i) * pi_theta(y_it) / sg(pi_theta(y_it))

The token form (the paper's GSPO-token with one advantage per sequence) has the value s_i on
every token and the gradient s_i grad log pi_theta(y_it), so with ``--loss-agg-mode
seq-mean-token-mean`` the gradient is the paper's (1/G) sum_i s_i A_i (1/n_i) sum_t grad log
pi_theta(y_it); a clipped sequence contributes no gradient. The paper's clip range is far
narrower than GRPO's (3e-4 / 4e-4 in its section 5.1, as TRL's documentation repeats).

Peers: TRL ``importance_sampling_level="sequence"`` (with ``loss_type="grpo"``), verl
``policy_loss.loss_mode=gspo`` (always ``seq-mean-token-mean``), NeMo-RL
``loss_fn.sequence_level_importance_ratios`` (with ``token_level_loss: false``).

Metrics: ``gspo_ratio_mean`` (mean s_i over the sequences with loss tokens) and
``gspo_clipped_sequence_fraction`` (the share of them whose clip binds); ``clip_fraction`` counts
the tokens of those sequences.
"""

from __future__ import annotations

import torch

from megatron.rl.grpo.policy_loss.base import Surrogate

SUMS = ("gspo/clipped_sequences", "gspo/ratio", "gspo/sequences")
"""The raw sums ``surrogate`` reports (added over micro-batches and ranks, then ``metrics``)."""


def sequence_log_ratios(
    trainer_logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """(B,) log s_i: the mean over each row's loss tokens of log pi_theta - log pi_old (0 for a
    row without loss tokens), without gradient."""
    with torch.no_grad():
        tokens = mask.sum(dim=1).clamp(min=1)
        return ((trainer_logprobs.detach() - old_logprobs) * mask).sum(dim=1) / tokens


def surrogate(
    trainer_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_lower: float,
    eps_upper: float,
) -> Surrogate:
    """The GSPO objective (module docstring) of (B, T) logprobs, (B, 1) advantages and the (B, T)
    loss mask."""
    log_s = sequence_log_ratios(trainer_logprobs, old_logprobs, mask)  # (B,)
    log_s_it = trainer_logprobs - trainer_logprobs.detach() + log_s[:, None]  # value: log s_i
    s_it = torch.exp(log_s_it)  # (B, T)
    unclipped = s_it * advantages
    clipped = s_it.clamp(1.0 - eps_lower, 1.0 + eps_upper) * advantages
    objective = torch.minimum(unclipped, clipped)
    with torch.no_grad():
        tokens = mask.sum(dim=1)  # (B,)
        has_tokens = tokens > 0
        s = torch.exp(log_s)  # (B,)
        adv = advantages.reshape(-1)
        seq_clipped = (s.clamp(1.0 - eps_lower, 1.0 + eps_upper) * adv < s * adv) & has_tokens
        sums = {
            "gspo/clipped_sequences": seq_clipped.sum().double(),
            "gspo/ratio": (s * has_tokens).sum().double(),
            "gspo/sequences": has_tokens.sum().double(),
        }
        clipped_tokens = (tokens * seq_clipped).sum()
    return Surrogate(objective, clipped_tokens.float(), sums)


def metrics(sums: dict[str, float]) -> dict[str, float]:
    """``gspo_ratio_mean`` and ``gspo_clipped_sequence_fraction`` from the global sums."""
    sequences = max(sums["gspo/sequences"], 1.0)
    return {
        "gspo_ratio_mean": sums["gspo/ratio"] / sequences,
        "gspo_clipped_sequence_fraction": sums["gspo/clipped_sequences"] / sequences,
    }
