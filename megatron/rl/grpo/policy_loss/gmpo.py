"""GMPO: the geometric mean of the token ratios, each clipped in log space (Zhao et al. 2025,
"Geometric-Mean Policy Optimization", arXiv 2507.20673).

Per sequence i with loss tokens t (m_it = 1, n_i of them), d_it = log pi_theta(y_it) -
log pi_old(y_it) and the log-space clip c(d) = clip(d, -eps_lower, eps_upper):

    d'_it        = min(d_it, c(d_it)) if A_i >= 0, else max(d_it, c(d_it))
    objective_i  = A_i exp( (1/n_i) sum_t m_it d'_it )

which is the paper's sgn(A_i) (prod_t |min(r_it A_i, clip(r_it) A_i)|)^(1/n_i): PPO's
pessimistic clip per token (above for a positive advantage, below for a negative one), taken in
log space, then the geometric mean over the sequence instead of the arithmetic one, so a single
outlier ratio moves the objective far less. Every loss token of row i carries objective_i, so
with ``--loss-agg-mode seq-mean-token-mean`` the loss is the paper's -(1/|S|) sum_i objective_i,
whose gradient is -(1/|S|) sum_i objective_i (1/n_i) sum_t grad log pi_theta(y_it) over the
unclipped tokens t: a clipped token drops out, the rest of its sequence keeps its gradient.

``--grpo-clamp-eps-lower/upper`` bound log r here, not r (as verl's ``geo_mean`` reads its clip
ratios): the paper's range (e^-0.4, e^0.4) is ``--grpo-clamp-eps-lower 0.4
--grpo-clamp-eps-upper 0.4``.

Peers: verl ``policy_loss.loss_mode=geo_mean`` (which takes the geometric mean of the rollout IS
weights per sequence; here, as for every variant, they weigh each token).

Metrics: ``clip_fraction`` (loss tokens whose log ratio was clipped) and ``gmpo_ratio_mean``, the
mean over the sequences with loss tokens of exp((1/n_i) sum_t m_it d'_it).
"""

from __future__ import annotations

import torch

from megatron.rl.grpo.policy_loss.base import Surrogate

SUMS = ("gmpo/ratio", "gmpo/sequences")
"""The raw sums ``surrogate`` reports (added over micro-batches and ranks, then ``metrics``)."""


def surrogate(
    trainer_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_lower: float,
    eps_upper: float,
) -> Surrogate:
    """The GMPO objective (module docstring) of (B, T) logprobs, (B, 1) advantages and the (B, T)
    loss mask."""
    log_ratio = (trainer_logprobs - old_logprobs) * mask  # (B, T), 0 off the loss tokens
    bounded = log_ratio.clamp(-eps_lower, eps_upper)
    pessimistic = torch.where(
        advantages >= 0, torch.minimum(log_ratio, bounded), torch.maximum(log_ratio, bounded)
    )  # (B, T)
    tokens = mask.sum(dim=1, keepdim=True)  # (B, 1)
    mean_log = (pessimistic * mask).sum(dim=1, keepdim=True) / tokens.clamp(min=1)  # (B, 1)
    ratio = torch.exp(mean_log)  # (B, 1): the clipped geometric mean
    objective = (ratio * advantages).expand_as(log_ratio)  # (B, T)
    with torch.no_grad():
        clipped = ((pessimistic != log_ratio) & (mask > 0)).sum()
        has_tokens = tokens.reshape(-1) > 0  # (B,)
        sums = {
            "gmpo/ratio": (ratio.reshape(-1) * has_tokens).sum().double(),
            "gmpo/sequences": has_tokens.sum().double(),
        }
    return Surrogate(objective, clipped.float(), sums)


def metrics(sums: dict[str, float]) -> dict[str, float]:
    """``gmpo_ratio_mean`` from the global sums."""
    return {"gmpo_ratio_mean": sums["gmpo/ratio"] / max(sums["gmpo/sequences"], 1.0)}
