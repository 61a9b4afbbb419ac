"""The policy-loss variants through the CPU tier's ``Policy.train``: the same loss,
gradient and metrics whatever the micro-batch size and the data-parallel layout (the whole batch
on every rank, or each rank's keyed shard carrying the global counts), with two rows fully masked
out of the loss (as dynamic sampling or the sequence-level logprob error leave them).

Each variant runs two updates of one batch sharing pi_old (``--grpo-iterations`` 2), so the
second update's ratios differ from 1.
"""

from __future__ import annotations

import dataclasses

import pytest
from grpo_testing.batches import build_train_batch
from grpo_testing.distributed import run_on_ranks
from grpo_testing.models import VOCAB
from grpo_testing.rollouts import synthetic_groups
from grpo_testing.trainer import train_args

from megatron.rl.grpo.aggregation import LossAggregation
from megatron.rl.grpo.batch import GlobalCounts, TrainBatch
from megatron.rl.grpo.importance import ImportanceConfig
from megatron.rl.grpo.loss import GRPOLossConfig
from megatron.rl.grpo.off_policy_mask import OffPolicyMask
from megatron.rl.grpo.terms.entropy_bonus import EntropyBonus
from megatron.trainer.checkpoint.directory import TrainState
from megatron.trainer.config import model_build, optimizer_settings
from megatron.trainer.model.provider import build_model
from megatron.trainer.runtime.initialize import initialize_distributed, set_seeds
from megatron.trainer.tiers.cpu import CPUPolicy
from megatron.trainer.train.losses import GRPOLoss
from megatron.trainer.train.optimizer import build_optimizer
from megatron.trainer.train.policy import PolicyConfig
from megatron.trainer.train.step import MicroBatchCache, StepConfig

ROWS = 16
MASKED_ROWS = (3, 10)


def agg(mode: str, scale: float | None = None) -> LossAggregation:
    return LossAggregation(mode, scale)


VARIANTS: dict[str, dict] = {
    "gspo-seq-mean-token-mean-sequence-mis": dict(
        loss=GRPOLossConfig(3e-4, 4e-4, policy_loss="gspo", aggregation=agg("seq-mean-token-mean")),
        importance=ImportanceConfig(3.0, "sequence_mask", 0.05),
    ),
    "cispo-opsm": dict(
        loss=GRPOLossConfig(0.2, 0.05, policy_loss="cispo", off_policy_mask=OffPolicyMask(0.05)),
        importance=None,
    ),
    "seq-mean-token-sum-token-mis-entropy": dict(
        loss=GRPOLossConfig(
            0.2, 0.28, terms=(EntropyBonus(0.01),), aggregation=agg("seq-mean-token-sum")
        ),
        importance=ImportanceConfig(2.0, "token_mask", 0.3),
    ),
    "dr-grpo-sequence-tis-opsm": dict(
        loss=GRPOLossConfig(
            0.2,
            0.28,
            aggregation=agg("seq-mean-token-sum-norm", 6.0),
            off_policy_mask=OffPolicyMask(0.0),
        ),
        importance=ImportanceConfig(1.0, "sequence_truncate", 0.2),
    ),
}


def data() -> TrainBatch:
    batch = build_train_batch(synthetic_groups(4, 4, VOCAB, seed=3), pad_id=0)
    mask = batch.loss_mask.clone()
    mask[list(MASKED_ROWS)] = 0.0
    return dataclasses.replace(batch, loss_mask=mask)


def shard_of(batch: TrainBatch, dp_rank: int, dp_size: int) -> TrainBatch:
    """This rank's rows as a keyed shard carrying the global batch's counts."""
    per_rank = batch.num_rows // dp_size
    counts = GlobalCounts(
        rows=batch.num_rows,
        loss_tokens=batch.num_loss_tokens,
        trained_tokens=int(batch.lengths.sum()),
        loss_sequences=batch.num_loss_sequences,
    )
    rows = batch.rows(dp_rank * per_rank, (dp_rank + 1) * per_rank, trim=False)
    return rows.as_shard(counts)


def variant_steps(rank: int, world_size: int, micro_batch_size: int, shards: bool) -> dict:
    """Two updates of every variant from the same initial weights: (loss, grad norm, metrics)."""
    args = train_args()
    ctx = initialize_distributed(args)
    results = {}
    for name, options in VARIANTS.items():
        set_seeds(args.training.seed, cuda=False)  # the seed's weights for every variant
        model = build_model(model_build(args), VOCAB, ctx.device)
        state = TrainState(model, *build_optimizer(model, optimizer_settings(args)))
        config = StepConfig(
            options["loss"],
            VOCAB,
            micro_batch_size,
            clip_grad=0.5,
            old_logprobs=True,
            importance=options["importance"],
        )
        policy = CPUPolicy(state, PolicyConfig.of(config), ctx)
        batch = shard_of(data(), ctx.dp_rank, ctx.dp_size) if shards else data()
        caches = [MicroBatchCache() for _ in range(ROWS // ctx.dp_size // micro_batch_size)]
        steps = []
        for _ in range(2):
            (r,) = policy.train(batch, GRPOLoss(config), caches=caches)
            steps.append((r.loss, r.grad_norm, r.loss_tokens, r.metrics))
        results[name] = steps
    return results


@pytest.fixture(scope="module")
def reference():
    (result,) = run_on_ranks(variant_steps, 1, 16, False)
    return result


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        for (loss, norm, tokens, metrics), (w_loss, w_norm, w_tokens, w_metrics) in zip(
            got[name], want[name]
        ):
            assert loss == pytest.approx(w_loss, rel=1e-5, abs=1e-7), name
            assert norm == pytest.approx(w_norm, rel=1e-5), name
            assert tokens == w_tokens
            assert metrics.keys() == w_metrics.keys(), name
            for key in metrics:
                assert metrics[key] == pytest.approx(w_metrics[key], rel=1e-5, abs=1e-7), (
                    name,
                    key,
                )


@pytest.mark.parametrize(
    "world_size, micro_batch_size, shards",
    [
        pytest.param(1, 2, False, id="micro-batch-2-vs-16"),
        pytest.param(1, 8, False, id="micro-batch-8-vs-16"),
        pytest.param(2, 2, False, id="data-parallel-2"),
        pytest.param(2, 4, True, id="data-parallel-2-keyed-shards"),
    ],
)
def test_variants_do_not_depend_on_micro_batches_or_data_parallelism(
    reference, world_size, micro_batch_size, shards
):
    for rank_result in run_on_ranks(variant_steps, world_size, micro_batch_size, shards):
        assert_same(rank_result, reference)


def test_the_reference_exercises_every_variant(reference):
    """Every variant's metrics are logged, and its masks and clips are neither all nor none."""
    g0, g1 = reference["gspo-seq-mean-token-mean-sequence-mis"]
    assert g0[3]["gspo_ratio_mean"] == 1.0 and g0[3]["gspo_clipped_sequence_fraction"] == 0.0
    assert g1[3]["gspo_ratio_mean"] != 1.0 and 0 < g1[3]["gspo_clipped_sequence_fraction"] < 1
    assert 0 < g0[3]["is_masked_sequence_fraction"] < 1
    assert g0[2] == g1[2] == data().num_loss_tokens
    c0, c1 = reference["cispo-opsm"]
    assert 0 < c0[3]["opsm_masked_sequence_fraction"] < 1
    assert c0[3]["clip_fraction"] == 0.0 and c0[3]["cispo_weight_mean"] == 1.0  # vs pi_old
    assert 0 < c1[3]["clip_fraction"] < 1 and c1[3]["cispo_weight_mean"] != 1.0
    s0, _ = reference["seq-mean-token-sum-token-mis-entropy"]
    assert 0 < s0[3]["is_masked_fraction"] < 1 and "entropy" in s0[3]
    d0, _ = reference["dr-grpo-sequence-tis-opsm"]
    assert 0 < d0[3]["is_truncated_sequence_fraction"] < 1
    assert "is_masked_fraction" not in d0[3]


def test_a_sequence_mean_weighs_rows_not_tokens():
    """The same batch under token-mean and seq-mean-token-mean gives other losses; with every
    row of one length they would agree (here the rows' lengths differ)."""
    batch = data()
    lengths = batch.loss_mask.sum(1)
    assert len(set(lengths[lengths > 0].tolist())) > 1
    assert batch.num_loss_sequences == ROWS - len(MASKED_ROWS)
