"""The policy interface (``megatron/trainer/train/policy.py``) on the CPU tier, each method against a
plain torch forward of the model: logprobs, reference logprobs, the distillation teacher's
logprobs and argmax, top-k logits (also packed, at TP=2 and DP=2), and ``train`` with a loss
function that is not GRPO's (supervised NLL)."""

from __future__ import annotations

import pytest
import torch
from grpo_testing.batches import build_train_batch
from grpo_testing.distributed import run_on_ranks
from grpo_testing.models import VOCAB
from grpo_testing.rollouts import synthetic_groups
from grpo_testing.trainer import one_rank_context, train_args
from megatron.core import parallel_state

from megatron.rl.grpo.batch import TrainBatch
from megatron.rl.grpo.distill import DistillConfig
from megatron.rl.grpo.loss import GRPOLossConfig
from megatron.trainer.checkpoint.directory import TrainState
from megatron.trainer.config import tier_config
from megatron.trainer.tiers.cpu import CPUTier
from megatron.trainer.train.losses import GRPOLoss, TokenMeanNLL
from megatron.trainer.train.policy import PolicyConfig
from megatron.trainer.train.step import StepConfig

K = 5


def batch(seed: int = 1) -> TrainBatch:
    """8 right-padded rows (temperatures 1.0 and 0.8)."""
    return build_train_batch(synthetic_groups(2, 4, VOCAB, seed=seed), pad_id=0)


def build_policy(
    ctx, micro_batch_size=3, packing_capacity=None, reference_seed=None, teacher_seed=None
):
    """A CPU policy from seed 7 (and a reference model from ``reference_seed``, a distillation
    teacher from ``teacher_seed``)."""
    args = train_args(tensor_model_parallel_size=ctx.tp_size)
    tier = CPUTier(tier_config(args), ctx)
    reference = teacher = None
    if reference_seed is not None:
        torch.manual_seed(reference_seed)
        reference = tier.build_reference(VOCAB).eval()
    if teacher_seed is not None:
        torch.manual_seed(teacher_seed)
        teacher = tier.build_reference(VOCAB).eval()
    torch.manual_seed(7)
    model = tier.build_model(VOCAB)
    state = TrainState(model, *tier.build_optimizer(model))
    config = PolicyConfig(VOCAB, micro_batch_size, args.training.clip_grad, packing_capacity)
    return tier.build_policy(state, config, reference, teacher)


def direct_logits(model: torch.nn.Module, data: TrainBatch) -> torch.Tensor:
    """(B, T, V) logits of the real vocabulary: one plain forward of the whole batch."""
    ids = data.input_ids
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1])[None].expand_as(ids), None)[..., :VOCAB]


def direct_logprobs(model: torch.nn.Module, data: TrainBatch) -> torch.Tensor:
    """(B, T) log softmax(logits / temperature) of the targets."""
    logits = direct_logits(model, data) / data.temperature[:, None, None]
    return torch.log_softmax(logits, -1).gather(-1, data.target_ids[..., None])[..., 0]


def valid(data: TrainBatch) -> torch.Tensor:
    """(B, T) True at each row's real positions."""
    return torch.arange(data.input_ids.shape[1])[None] < data.lengths[:, None]


@pytest.fixture
def ctx(single_rank_world):
    parallel_state.initialize_model_parallel()
    return one_rank_context()


@pytest.mark.parametrize(
    "micro_batch_size, packing",
    [
        pytest.param(3, None, id="micro-batches-of-3"),
        pytest.param(8, None, id="one-micro-batch"),
        pytest.param(3, 24, id="packed"),
    ],
)
def test_get_logprobs_is_a_forward_without_gradient(ctx, micro_batch_size, packing):
    policy = build_policy(ctx, micro_batch_size, packing)
    data = batch()
    got = policy.get_logprobs(data)
    assert got.shape == data.input_ids.shape and got.dtype == torch.float32
    assert not got.requires_grad
    assert all(p.grad is None for p in policy.state.model.parameters())
    want = direct_logprobs(policy.state.model, data)
    mask = valid(data)
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)
    assert torch.all(got[~mask].abs() < 1e9)  # padding: finite filler the callers mask


def test_get_logprobs_micro_batch_size_argument_overrides_the_config(ctx):
    policy, data = build_policy(ctx, micro_batch_size=8), batch()
    mask = valid(data)
    torch.testing.assert_close(
        policy.get_logprobs(data, micro_batch_size=1)[mask],
        policy.get_logprobs(data)[mask],
        atol=1e-5,
        rtol=1e-5,
    )


def test_get_reference_policy_logprobs_uses_the_frozen_reference(ctx):
    policy, data = build_policy(ctx, reference_seed=11), batch()
    got = policy.get_reference_policy_logprobs(data, micro_batch_size=2)
    mask = valid(data)
    want = direct_logprobs(policy.reference, data)
    torch.testing.assert_close(got[mask], want[mask], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[mask], policy.get_logprobs(data)[mask])  # another model
    with pytest.raises(ValueError, match="no reference model.*--grpo-kl-beta"):
        build_policy(ctx).get_reference_policy_logprobs(data)


@pytest.mark.parametrize("packing", [pytest.param(None, id="plain"), pytest.param(24, id="packed")])
def test_get_teacher_logprobs_are_the_teachers_at_temperature_one_with_its_argmax(ctx, packing):
    policy, data = build_policy(ctx, packing_capacity=packing, teacher_seed=13), batch()
    assert (data.temperature < 1).any()  # rows at 0.8: the teacher still scores at 1
    got = policy.get_teacher_logprobs(data, micro_batch_size=2)
    assert got.logprobs.shape == got.argmax.shape == data.input_ids.shape
    assert got.argmax.dtype == torch.int64 and not got.logprobs.requires_grad
    logits = direct_logits(policy.teacher, data)  # untempered: temperature 1 on every row
    want = torch.log_softmax(logits, -1).gather(-1, data.target_ids[..., None])[..., 0]
    mask = valid(data)
    torch.testing.assert_close(got.logprobs[mask], want[mask], atol=1e-5, rtol=1e-5)
    assert torch.equal(got.argmax[mask], logits.argmax(-1)[mask])
    assert got.topk_logprobs is None and got.topk_ids is None
    with_topk = policy.get_teacher_logprobs(data, micro_batch_size=2, topk=K)  # top-k variant
    assert torch.equal(with_topk.logprobs, got.logprobs)
    top = torch.log_softmax(logits, -1).topk(K, dim=-1)
    assert with_topk.topk_logprobs.shape == with_topk.topk_ids.shape == (*data.input_ids.shape, K)
    torch.testing.assert_close(with_topk.topk_logprobs[mask], top.values[mask])
    assert torch.equal(with_topk.topk_ids[mask], top.indices[mask])
    assert torch.equal(with_topk.argmax, with_topk.topk_ids[..., 0])
    with pytest.raises(ValueError, match="no distillation teacher \\(--distill-teacher\\)"):
        build_policy(ctx).get_teacher_logprobs(data)


@pytest.mark.parametrize("packing", [pytest.param(None, id="plain"), pytest.param(24, id="packed")])
def test_get_topk_logits_are_the_largest_next_token_logits(ctx, packing):
    policy, data = build_policy(ctx, packing_capacity=packing), batch()
    top = policy.get_topk_logits(data, K)
    assert top.values.shape == top.indices.shape == (*data.input_ids.shape, K)
    assert top.indices.dtype == torch.int64 and int(top.indices.max()) < VOCAB
    want_values, want_indices = direct_logits(policy.state.model, data).topk(K, dim=-1)
    mask = valid(data)
    torch.testing.assert_close(top.values[mask], want_values[mask], atol=1e-5, rtol=1e-5)
    assert torch.equal(top.indices[mask], want_indices[mask])  # untempered (rows at 0.8 too)


def nll(model: torch.nn.Module, data: TrainBatch) -> float:
    """Token mean of -log pi over the loss-mask tokens: a direct computation."""
    logprobs = direct_logprobs(model, data)
    return float(-(logprobs * data.loss_mask).sum() / data.loss_mask.sum())


def test_train_minimizes_a_supervised_nll_loss(ctx):
    policy, data = build_policy(ctx), batch()
    losses = []
    for _ in range(6):
        before = nll(policy.state.model, data)
        (result,) = policy.train(data, TokenMeanNLL())
        assert result.loss == pytest.approx(before, rel=1e-5)  # the loss before the update
        assert result.loss_tokens == data.num_loss_tokens and result.grad_norm > 0
        assert result.metrics == {}
        losses.append(result.loss)
    assert all(b < a for a, b in zip(losses, losses[1:]))
    assert nll(policy.state.model, data) < 0.9 * losses[0]
    assert policy.state.scheduler.num_steps == 6


def test_eval_mode_computes_the_loss_and_leaves_the_weights_untouched(ctx):
    policy, data = build_policy(ctx), batch()
    weights = [p.detach().clone() for p in policy.state.model.parameters()]
    (result,) = policy.train(data, TokenMeanNLL(), eval_mode=True)
    assert result.loss == pytest.approx(nll(policy.state.model, data), rel=1e-5)
    assert all(torch.equal(a, p) for a, p in zip(weights, policy.state.model.parameters()))
    assert all(p.grad is None for p in policy.state.model.parameters())
    assert policy.state.scheduler.num_steps == 0 and not policy.state.optimizer.state
    (trained,) = policy.train(data, TokenMeanNLL())
    assert trained.loss == result.loss  # the same forward, now with an update


def test_train_runs_one_update_per_global_batch(ctx):
    policy, data = build_policy(ctx), batch()
    halves = [data.rows(0, 4, trim=False), data.rows(4, 8, trim=False)]
    want_first = nll(policy.state.model, halves[0])
    results = policy.train(data, TokenMeanNLL(), gbs=4, mbs=2)
    assert len(results) == 2 and policy.state.scheduler.num_steps == 2
    assert results[0].loss == pytest.approx(want_first, rel=1e-5)
    assert [r.loss_tokens for r in results] == [h.num_loss_tokens for h in halves]
    with pytest.raises(ValueError, match="gbs \\(3\\) must divide the 8 rows"):
        policy.train(data, TokenMeanNLL(), gbs=3)


def policy_outputs(rank: int, world_size: int, tp: int):
    """Every method's result on ``world_size`` gloo ranks with TP ``tp`` (DP the rest)."""
    from megatron.trainer.runtime.initialize import initialize_distributed

    ctx = initialize_distributed(train_args(tensor_model_parallel_size=tp))
    policy, data = build_policy(ctx, micro_batch_size=2, teacher_seed=13), batch()
    top = policy.get_topk_logits(data, K)
    logprobs = policy.get_logprobs(data)
    teacher = policy.get_teacher_logprobs(data, topk=K)
    distill = StepConfig(
        GRPOLossConfig(0.2, 0.2), VOCAB, 2, 1.0, distill=DistillConfig(1.0, False, topk=K)
    )
    (distilled,) = policy.train(data, GRPOLoss(distill, teacher=teacher))  # top-k: the support
    (evaluated,) = policy.train(data, TokenMeanNLL(), eval_mode=True)
    trained = [policy.train(data, TokenMeanNLL())[0] for _ in range(2)]
    losses = [distilled.metrics["distill/topk_kl"], evaluated.loss] + [r.loss for r in trained]
    norms = [distilled.grad_norm] + [r.grad_norm for r in trained]
    return top.values, top.indices, logprobs, teacher, losses, norms, valid(data)


@pytest.mark.parametrize(
    "world_size, tp",
    [pytest.param(2, 2, id="tensor-parallel-2"), pytest.param(2, 1, id="data-parallel-2")],
)
def test_every_method_is_invariant_to_the_parallel_layout(world_size, tp):
    ((values, indices, logprobs, teacher, losses, norms, mask),) = run_on_ranks(
        policy_outputs, 1, 1
    )
    assert losses[0] > 0 and norms[0] > 0  # the top-k KL to another model: a real gradient
    for got in run_on_ranks(policy_outputs, world_size, tp):
        got_values, got_indices, got_logprobs, got_teacher, got_losses, got_norms, _ = got
        torch.testing.assert_close(got_values[mask], values[mask], atol=1e-5, rtol=1e-5)
        assert torch.equal(got_indices[mask], indices[mask])
        torch.testing.assert_close(got_logprobs[mask], logprobs[mask], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            got_teacher.logprobs[mask], teacher.logprobs[mask], atol=1e-5, rtol=1e-5
        )
        assert torch.equal(got_teacher.argmax[mask], teacher.argmax[mask])
        torch.testing.assert_close(
            got_teacher.topk_logprobs[mask], teacher.topk_logprobs[mask], atol=1e-5, rtol=1e-5
        )
        assert torch.equal(got_teacher.topk_ids[mask], teacher.topk_ids[mask])
        assert got_losses == pytest.approx(losses, rel=1e-5)
        assert got_norms == pytest.approx(norms, rel=1e-5)


def test_the_top_k_distillation_loss_is_the_same_packed_and_unpacked(ctx):
    """The policy's logprobs of the teacher's top-k ids (``LossFunction.support_ids``) follow
    the packed layout: the same loss, KL and gradient norm as the plain forward."""
    results = []
    for packing in (None, 24):
        policy, data = build_policy(ctx, packing_capacity=packing, teacher_seed=13), batch()
        teacher = policy.get_teacher_logprobs(data, topk=K)
        config = StepConfig(
            GRPOLossConfig(0.2, 0.2),
            VOCAB,
            3,
            1.0,
            packing_capacity=packing,
            distill=DistillConfig(0.5, topk=K),
        )
        (result,) = policy.train(data, GRPOLoss(config, teacher=teacher))
        results.append((result.loss, result.metrics["distill/topk_kl"], result.grad_norm))
    assert results[0][1] > 0
    assert results[1] == pytest.approx(results[0], rel=1e-5)
