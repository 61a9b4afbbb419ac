"""GMPO (``--policy-loss gmpo``) by hand: the geometric mean of the log-space clipped token
ratios times the advantage, which bound clips for which sign of the advantage, the gradient of
the clipped and unclipped tokens, the metrics and the edge rows."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.rl.grpo.aggregation import LossAggregation
from megatron.rl.grpo.loss import GRPOLossConfig, LossInputs, grpo_loss, variant_metrics

OLD_LOGP = math.log(0.4)
SEQ_MEAN = LossAggregation("seq-mean-token-mean", None)
# log r is clipped into [-0.2, 0.4]
GMPO = GRPOLossConfig(clamp_eps_lower=0.2, clamp_eps_upper=0.4, policy_loss="gmpo")
GMPO_SEQ = GRPOLossConfig(0.2, 0.4, policy_loss="gmpo", aggregation=SEQ_MEAN)


def rows(log_ratios: list[list[float]], advantages: list[float], mask: list[list[float]] | None):
    """Rows whose tokens have log(pi_theta / pi_old) = ``log_ratios``."""
    d = torch.tensor(log_ratios, dtype=torch.float64)
    old = torch.full_like(d, OLD_LOGP)
    trainer = (old + d).requires_grad_()
    m = torch.ones_like(d) if mask is None else torch.tensor(mask, dtype=torch.float64)
    inputs = LossInputs(
        trainer_logprobs=trainer,
        inference_logprobs=old,
        advantages=torch.tensor(advantages, dtype=torch.float64),
        loss_mask=m,
    )
    return trainer, inputs


# log ratios, advantage, clipped log ratios' mean (log of the geometric mean), clipped tokens,
# d loss / d log pi_theta per token under seq-mean-token-mean: -A e^mean / n on unclipped tokens
E = math.exp
CASES = [
    pytest.param([0.1, 0.3], 1.0, 0.2, 0, [-E(0.2) / 2, -E(0.2) / 2], id="inside-range"),
    pytest.param([0.2, 0.6], 1.0, 0.3, 1, [-E(0.3) / 2, 0.0], id="positive-adv-clipped-above"),
    pytest.param(
        [-0.6, 0.2], 2.0, -0.2, 0, [-E(-0.2), -E(-0.2)], id="positive-adv-not-clipped-below"
    ),
    pytest.param([-0.6, 0.2], -1.0, 0.0, 1, [0.0, 0.5], id="negative-adv-clipped-below"),
    pytest.param(
        [0.6, 0.2], -1.0, 0.4, 0, [E(0.4) / 2, E(0.4) / 2], id="negative-adv-not-clipped-above"
    ),
    pytest.param([0.9], 0.0, 0.4, 1, [0.0], id="zero-advantage-no-gradient"),
    pytest.param(
        [-1.0, 0.0, 2.0],
        1.0,
        (-1.0 + 0.0 + 0.4) / 3,
        1,
        [-E(-0.2) / 3, -E(-0.2) / 3, 0.0],
        id="outlier-ratio-barely-moves-the-mean",
    ),
]


@pytest.mark.parametrize("log_ratios, advantage, mean_log, clipped, grad", CASES)
def test_sequence_objective_and_gradient_by_hand(log_ratios, advantage, mean_log, clipped, grad):
    trainer, inputs = rows([log_ratios], [advantage], None)
    out = grpo_loss(inputs, GMPO_SEQ)
    objective = advantage * math.exp(mean_log)
    assert out.loss_sum.item() == pytest.approx(-objective, abs=1e-12)
    assert out.clipped_tokens.item() == clipped
    assert out.variant_sums["gmpo/ratio"].item() == pytest.approx(math.exp(mean_log))
    assert out.variant_sums["gmpo/sequences"].item() == 1.0
    out.loss_sum.backward()
    torch.testing.assert_close(trainer.grad, torch.tensor([grad], dtype=torch.float64))


def test_token_mean_gives_every_loss_token_the_sequence_objective():
    """Row 0: log ratios 0.2, 0.6 (the second clipped to 0.4), A = 1: objective e^0.3 on both
    tokens; row 1: one loss token of log ratio -0.5 and A = -2 (clipped to -0.2), a padding
    token whose huge ratio must not count: objective -2 e^-0.2."""
    trainer, inputs = rows([[0.2, 0.6], [-0.5, 9.0]], [1.0, -2.0], [[1.0, 1.0], [1.0, 0.0]])
    out = grpo_loss(inputs, GMPO)
    assert out.loss_sum.item() == pytest.approx(-2 * E(0.3) + 2 * E(-0.2), abs=1e-12)
    assert out.clipped_tokens.item() == 2
    out.loss_sum.backward()  # row 0: 2 tokens x d/dd_t (e^mean) = 2 x e^0.3 / 2 on token 0
    expected = torch.tensor([[-E(0.3), 0.0], [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(trainer.grad, expected)


def test_a_fully_masked_row_contributes_nothing_and_is_not_counted():
    trainer, inputs = rows([[0.3, 0.1], [5.0, -5.0]], [1.0, 1.0], [[1.0, 1.0], [0.0, 0.0]])
    out = grpo_loss(inputs, GMPO_SEQ)
    assert out.loss_sum.item() == pytest.approx(-E(0.2), abs=1e-12)
    assert out.variant_sums["gmpo/sequences"].item() == 1.0
    assert out.clipped_tokens.item() == 0
    out.loss_sum.backward()
    assert torch.all(trainer.grad[1] == 0)


def test_the_metric_is_the_mean_ratio_over_sequences_with_loss_tokens():
    sums = {"gmpo/ratio": 3.0, "gmpo/sequences": 2.0}
    assert variant_metrics(sums, GMPO) == {"gmpo_ratio_mean": 1.5}
    assert GMPO.sum_keys() == ("gmpo/ratio", "gmpo/sequences")
