"""On-policy distillation's teacher term (``megatron/rl/grpo/distill.py``) and per-token advantages
in the GRPO loss, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from megatron.rl.grpo.distill import (
    DISTILL_SUMS,
    TOPK_SUMS,
    DistillConfig,
    distill_sums,
    sequence_advantages,
    teacher_advantages,
    topk_reverse_kl,
    topk_sums,
)
from megatron.rl.grpo.loss import GRPOLossConfig, LossInputs, grpo_loss
from megatron.rl.grpo.off_policy_mask import OffPolicyMask

TEACHER = torch.tensor([[-0.5, -2.0, -1.0], [-3.0, -0.1, -9.0]])  # (B=2, T=3)
STUDENT = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # the first row's last token is padding


@pytest.mark.parametrize(
    "coef, expected",
    [
        pytest.param(1.0, [[0.5, -1.0, 0.0], [-2.0, 0.9, -8.0]], id="coef-1"),
        pytest.param(0.5, [[0.25, -0.5, 0.0], [-1.0, 0.45, -4.0]], id="coef-half"),
    ],
)
def test_teacher_advantage_is_coef_times_teacher_minus_student_on_loss_tokens(coef, expected):
    advantages = teacher_advantages(TEACHER, STUDENT, MASK, DistillConfig(coef))
    assert torch.allclose(advantages, torch.tensor(expected))


def test_a_teacher_equal_to_the_student_gives_exactly_zero():
    advantages = teacher_advantages(STUDENT, STUDENT.clone(), MASK, DistillConfig(2.0))
    assert torch.equal(advantages, torch.zeros_like(STUDENT))


@pytest.mark.parametrize(
    "config, expected",
    [
        pytest.param(DistillConfig(1.0), [1.5, -0.5], id="with-reward"),
        pytest.param(DistillConfig(1.0, reward=False), [0.0, 0.0], id="only"),
    ],
)
def test_only_drops_the_environment_advantage(config, expected):
    assert sequence_advantages(torch.tensor([1.5, -0.5]), config).tolist() == expected


@pytest.mark.parametrize("coef", [0.0, -1.0, math.nan])
def test_a_coefficient_that_is_not_positive_is_refused(coef):
    with pytest.raises(ValueError, match="coefficient must be > 0"):
        DistillConfig(coef)


def test_metric_sums_by_hand():
    targets = torch.tensor([[5, 6, 7], [1, 2, 3]])
    argmax = torch.tensor([[5, 0, 0], [1, 9, 3]])  # mismatches on loss tokens: (0,1), (1,1)
    sums = distill_sums(TEACHER, STUDENT, argmax, targets, MASK)
    assert tuple(sorted(sums)) == DISTILL_SUMS
    # student - teacher on the 5 loss tokens: -0.5 + 1.0 + 2.0 - 0.9 + 8.0
    assert sums["distill/reverse_kl"].item() == pytest.approx(9.6)
    assert sums["distill/teacher_logprob"].item() == pytest.approx(-0.5 - 2.0 - 3.0 - 0.1 - 9.0)
    assert sums["distill/student_logprob"].item() == pytest.approx(-5.0)
    assert sums["distill/argmax_mismatch"].item() == 2.0


CONFIG = GRPOLossConfig(clamp_eps_lower=0.2, clamp_eps_upper=0.2)


def loss_inputs(token_advantages: torch.Tensor | None) -> tuple[torch.Tensor, LossInputs]:
    """One row of two tokens at ratio 1 (trainer == engine), sequence advantage 1."""
    trainer = torch.log(torch.tensor([[0.5, 0.25]], dtype=torch.float64)).requires_grad_()
    return trainer, LossInputs(
        trainer_logprobs=trainer,
        inference_logprobs=trainer.detach().clone(),
        advantages=torch.tensor([1.0], dtype=torch.float64),
        loss_mask=torch.ones(1, 2, dtype=torch.float64),
        token_advantages=token_advantages,
    )


def test_per_token_advantages_add_to_the_sequence_advantage_in_the_surrogate():
    trainer, inputs = loss_inputs(torch.tensor([[0.5, -3.0]], dtype=torch.float64))
    out = grpo_loss(inputs, CONFIG)
    # ratio 1 on both tokens: loss = -(1 + 0.5) - (1 - 3.0) = 0.5; d loss / d log pi = -A_t
    assert out.loss_sum.item() == pytest.approx(0.5)
    out.loss_sum.backward()
    assert trainer.grad[0].tolist() == pytest.approx([-1.5, 2.0])


def test_per_token_advantages_are_clipped_token_by_token():
    trainer, inputs = loss_inputs(torch.tensor([[0.5, -3.0]], dtype=torch.float64))
    shifted = torch.log(torch.tensor([[0.5 * 1.5, 0.25 * 1.5]], dtype=torch.float64))
    inputs = LossInputs(**{**inputs.__dict__, "trainer_logprobs": shifted.requires_grad_()})
    out = grpo_loss(inputs, CONFIG)
    # ratio 1.5: the positive-advantage token is clipped at 1.2, the negative one is not
    assert out.loss_sum.item() == pytest.approx(-1.2 * 1.5 + 1.5 * 2.0)
    assert out.clipped_tokens.item() == 1.0


def test_a_sequence_level_surrogate_refuses_per_token_advantages():
    _, inputs = loss_inputs(torch.zeros(1, 2, dtype=torch.float64))
    config = GRPOLossConfig(clamp_eps_lower=0.2, clamp_eps_upper=0.2, policy_loss="gspo")
    with pytest.raises(ValueError, match="'gspo' takes one advantage per sequence"):
        grpo_loss(inputs, config)


def test_the_off_policy_mask_reads_the_mean_advantage_of_each_sequence():
    trainer, inputs = loss_inputs(torch.tensor([[-2.0, -2.0]], dtype=torch.float64))
    assert inputs.advantage_per_sequence().tolist() == [-1.0]
    drifted = LossInputs(
        **{**inputs.__dict__, "inference_logprobs": inputs.inference_logprobs + 1.0}
    )
    config = GRPOLossConfig(
        clamp_eps_lower=0.2, clamp_eps_upper=0.2, off_policy_mask=OffPolicyMask(0.5)
    )
    out = grpo_loss(drifted, config)  # negative mean advantage and KL 1 > 0.5: masked
    assert out.loss_sum.item() == 0.0
    assert out.variant_sums["opsm/masked_sequences"].item() == 1.0


# The top-k variant: one position, the teacher's top-2 ids. The student puts 0.3 and 0.1 on them
# (0.75 and 0.25 renormalized), the teacher 0.4 and 0.4 (0.5 and 0.5).
STUDENT_TOP = torch.log(torch.tensor([[[0.3, 0.1]]], dtype=torch.float64))  # (B=1, T=1, k=2)
TEACHER_TOP = torch.log(torch.tensor([[[0.4, 0.4]]], dtype=torch.float64))
KL_BY_HAND = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)  # 0.130812


def test_topk_reverse_kl_is_the_kl_of_the_renormalized_distributions_by_hand():
    student = STUDENT_TOP.clone().requires_grad_()
    kl = topk_reverse_kl(student, TEACHER_TOP, torch.ones(1, 1, dtype=torch.float64))
    assert kl.item() == pytest.approx(KL_BY_HAND)
    kl.sum().backward()
    # d KL / d log pi_i = p_i (log p_i / q_i - KL): +-0.205990, zero in sum (renormalization)
    expected = [0.75 * (math.log(1.5) - KL_BY_HAND), 0.25 * (math.log(0.5) - KL_BY_HAND)]
    assert student.grad[0, 0].tolist() == pytest.approx(expected)
    assert student.grad.sum().item() == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize(
    "student, mask, expected",
    [
        pytest.param(TEACHER_TOP + math.log(0.5), [[1.0]], 0.0, id="proportional-to-the-teacher"),
        pytest.param(STUDENT_TOP, [[0.0]], 0.0, id="not-a-loss-token"),
        pytest.param(STUDENT_TOP, [[1.0]], KL_BY_HAND, id="by-hand"),
    ],
)
def test_topk_reverse_kl_only_compares_shapes_on_the_support(student, mask, expected):
    kl = topk_reverse_kl(student, TEACHER_TOP, torch.tensor(mask, dtype=torch.float64))
    assert kl.item() == pytest.approx(expected, abs=1e-12)


def test_topk_sums_by_hand():
    kl = topk_reverse_kl(STUDENT_TOP, TEACHER_TOP, torch.ones(1, 1, dtype=torch.float64))
    sums = topk_sums(kl, STUDENT_TOP, TEACHER_TOP, torch.ones(1, 1))
    assert tuple(sorted(sums)) == TOPK_SUMS
    assert sums["distill/topk_kl"].item() == pytest.approx(KL_BY_HAND)
    assert sums["distill/student_topk_mass"].item() == pytest.approx(0.4)
    assert sums["distill/teacher_topk_mass"].item() == pytest.approx(0.8)


def test_the_top_k_variant_reports_its_sums_and_refuses_k_below_one():
    assert DistillConfig(1.0, topk=4).sum_keys() == DISTILL_SUMS + TOPK_SUMS
    assert DistillConfig(1.0).sum_keys() == DISTILL_SUMS
    with pytest.raises(ValueError, match="k >= 1, got 0"):
        DistillConfig(1.0, topk=0)


def test_topk_reverse_kl_gradient_is_the_derivative_of_its_value():
    g = torch.Generator().manual_seed(0)
    student = torch.randn(2, 3, 4, generator=g, dtype=torch.float64).requires_grad_()
    teacher = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda s: topk_reverse_kl(s, teacher, mask), (student,))


def test_without_the_teachers_argmax_its_mismatch_is_not_reported():
    sums = distill_sums(TEACHER, STUDENT, None, torch.zeros(2, 3, dtype=torch.long), MASK)
    assert tuple(sorted(sums)) == DISTILL_SUMS[1:] == DistillConfig(1.0, argmax=False).sum_keys()
    assert sums["distill/reverse_kl"].item() == pytest.approx(9.6)
    with pytest.raises(ValueError, match="top-k variant needs the teacher's top-k"):
        DistillConfig(1.0, topk=4, argmax=False)
