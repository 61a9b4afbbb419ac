"""The advantage and reward-shaping options in the trainer: their flags (peer spellings, checks),
the library configs they become, the advantages rank 0 publishes, and the rows a truncated
completion takes out of every rank's loss through the data plane."""

from __future__ import annotations

import pytest
import torch
from grpo_testing.batches import GRPO
from grpo_testing.rollouts import synthetic_groups

from megatron.rl.dataplane import KeyedDataPlane
from megatron.rl.dataplane.batches import publish_groups
from megatron.rl.grpo.advantages.compute import AdvantageConfig
from megatron.rl.grpo.batch import batch_advantages
from megatron.rl.grpo.overlong import OverlongConfig
from megatron.rl.rollout.generator import RolloutBatch
from megatron.trainer import config
from megatron.trainer.errors import UsageError
from megatron.trainer.flags.parse import check
from megatron.trainer.grpo import advantages_of
from megatron.trainer.metrics.log_line import format_log_line
from megatron.trainer.metrics.record import rollout_metrics
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.train.collection import KeyedCollection


def resolved(*argv: str):
    cfg, errors = check(list(argv))
    assert errors == []
    return cfg


def test_defaults_are_grpo_with_the_group_scale_and_no_shaping():
    cfg = resolved()
    assert config.advantage_config(cfg) == AdvantageConfig("grpo", "group")
    assert config.overlong_config(cfg) is None
    groups = synthetic_groups(2, 4, vocab=50)
    shaped = advantages_of(cfg, groups)
    assert torch.equal(shaped.advantages, batch_advantages(groups, GRPO))
    assert shaped.masked is None and shaped.metrics == {}  # the default run logs no advantages_*


@pytest.mark.parametrize(
    "argv, estimator, scale",
    [
        pytest.param(["--adv-estimator", "rloo"], "rloo", "group", id="rloo"),
        pytest.param(["--advantage-estimator", "rloo"], "rloo", "group", id="alias-rloo"),
        pytest.param(["--scale-rewards", "batch"], "grpo", "batch", id="batch"),
        pytest.param(["--scale-rewards", "none"], "grpo", "none", id="dr-grpo"),
        pytest.param(["--scale-rewards", "False"], "grpo", "none", id="trl-false-is-none"),
        pytest.param(["--scale-rewards", "true"], "grpo", "group", id="trl-true-is-group"),
    ],
)
def test_advantage_flags_and_their_peer_spellings(argv, estimator, scale):
    assert config.advantage_config(resolved(*argv)) == AdvantageConfig(estimator, scale)


@pytest.mark.parametrize(
    "argv, expected",
    [
        pytest.param(
            ["--overlong-buffer-len", "4"], OverlongConfig(4, 1.0, False, 16), id="buffer"
        ),
        pytest.param(
            ["--overlong-tokens", "4", "--overlong-buffer-penalty", "0.5"],
            OverlongConfig(4, 0.5, False, 16),
            id="areal-and-nemo-rl-spellings",
        ),
        pytest.param(
            [
                "--overlong-buffer-length",
                "2",
                "--overlong-buffer-penalty-factor",
                "2",
                "--rl-default-max-tokens",
                "8",
            ],
            OverlongConfig(2, 2.0, False, 8),
            id="default-budget",
        ),
        pytest.param(
            ["--mask-truncated-completions"], OverlongConfig(0, 1.0, True, 16), id="mask-only"
        ),
        pytest.param(
            ["--overlong-filtering"],
            OverlongConfig(0, 1.0, True, 16),
            id="nemo-rl-overlong-filtering",
        ),
    ],
)
def test_shaping_flags_and_their_peer_spellings(argv, expected):
    assert config.overlong_config(resolved(*argv)) == expected


@pytest.mark.parametrize(
    "argv, needle",
    [
        pytest.param(
            ["--overlong-penalty-factor", "0.5"],
            "--overlong-penalty-factor needs",
            id="factor-without-buffer",
        ),
        pytest.param(
            ["--overlong-buffer-len", "-1"],
            "--overlong-buffer-len must be >= 0",
            id="negative-buffer",
        ),
        pytest.param(
            ["--overlong-buffer-len", "4", "--overlong-penalty-factor", "-1"],
            "--overlong-penalty-factor must be >= 0",
            id="negative-factor",
        ),
        pytest.param(
            ["--mask-truncated-completions", "--rl-ignore-eos"],
            "would mask every rollout",
            id="mask-with-ignore-eos",
        ),
    ],
)
def test_bad_shaping_flags_are_reported_by_name(argv, needle):
    _, errors = check(argv)
    assert any(needle in e for e in errors), errors


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["--scale-rewards", "std"], id="scale"),
        pytest.param(["--adv-estimator", "gae"], id="estimator"),
    ],
)
def test_an_unknown_choice_is_a_usage_error(argv):
    with pytest.raises(UsageError) as info:
        check(argv)
    assert argv[0] in info.value.message
    assert f"invalid choice: '{argv[1]}'" in info.value.message


def test_rank_0_publishes_the_configured_advantages_with_their_metrics():
    groups = synthetic_groups(3, 4, vocab=50, seed=1)
    cfg = resolved("--adv-estimator", "rloo", "--scale-rewards", "batch")
    shaped = advantages_of(cfg, groups)
    assert torch.equal(
        shaped.advantages, batch_advantages(groups, AdvantageConfig("rloo", "batch"))
    )
    assert shaped.masked is None and set(shaped.metrics) == {
        "advantages_mean",
        "advantages_abs_mean",
        "advantages_min",
        "advantages_max",
    }


def cut_off(groups, rows: set[int]):
    """``groups`` with the rollouts at flat positions ``rows`` recorded as truncated at a budget
    of their own length, the others as ended by a stop token under a budget of 64."""
    out, i = [], 0
    for g in groups:
        rollouts = []
        for r in g.rollouts:
            n = sum(r.generation_mask)
            cut = i in rows
            rollouts.append(
                r.model_copy(
                    update={
                        "max_tokens": n if cut else 64,
                        "turn_lengths": [n],
                        "truncated": cut,
                    }
                )
            )
            i += 1
        out.append(g.model_copy(update={"rollouts": rollouts}))
    return out


def context() -> ParallelContext:
    return ParallelContext(0, 1, torch.device("cpu"), 0, 1, 0, 1, None, None)


def test_a_truncated_completion_is_fully_masked_on_every_rank_and_leaves_the_rest_alone():
    """--mask-truncated-completions: row 1's tokens carry no loss and leave the global
    token count, its advantage (it still counts in its group) and every other row are as without
    the mask; a later mask (the sequence-level logprob error's) adds to it."""
    groups = cut_off(synthetic_groups(2, 4, vocab=50, seed=4), rows={1})
    cfg = resolved("--mask-truncated-completions")
    shaped = advantages_of(cfg, groups)
    assert shaped.masked.tolist() == [False, True] + [False] * 6
    assert shaped.metrics["truncated_masked_rollouts"] == 1
    assert shaped.metrics["truncated_fraction"] == 1 / 8
    assert torch.equal(
        shaped.advantages, batch_advantages(groups, GRPO)
    )  # no penalty, same baseline

    def collection(masked):
        plane = KeyedDataPlane(0, 1, torch.device("cpu"))
        meta = publish_groups(plane, groups, step=3, advantages=shaped.advantages, masked=masked)
        return KeyedCollection(plane, meta, 8, 1, context(), pad_id=0)

    plain, masked = collection(None).global_batch(0), collection(shaped.masked)
    batch = masked.global_batch(0)
    assert batch.loss_mask[1].sum() == 0 and plain.loss_mask[1].sum() > 0
    assert batch.global_loss_tokens == plain.global_loss_tokens - int(plain.loss_mask[1].sum())
    keep = [0, 2, 3, 4, 5, 6, 7]
    assert torch.equal(batch.loss_mask[keep], plain.loss_mask[keep])
    assert torch.equal(batch.advantages, plain.advantages)
    masked.mask_rows(torch.tensor([True] * 5 + [False] + [True] * 2))  # another mask: row 5
    again = masked.global_batch(0)
    assert again.loss_mask[1].sum() == 0 and again.loss_mask[5].sum() == 0
    assert again.global_loss_tokens == int(again.loss_mask.sum())


@pytest.mark.parametrize(
    "shaping, shown",
    [
        pytest.param({}, None, id="off"),
        pytest.param(
            {"truncated_fraction": 0.25, "overlong_penalty_mean": -0.125},
            "| truncated rollouts 0.25 overlong penalty -0.125",
            id="penalty",
        ),
        pytest.param(
            {"truncated_fraction": 0.5, "truncated_masked_rollouts": 3},
            "| truncated rollouts 0.50 masked 3",
            id="mask",
        ),
    ],
)
def test_the_log_line_shows_the_shaping_that_is_on(shaping, shown):
    groups = synthetic_groups(2, 2, vocab=20)
    record = rollout_metrics(RolloutBatch(0, groups, in_flight=1, queue_depth=0), step=0)
    m = {
        **record,
        "step": 0,
        "loss": 0.0,
        "grad_norm": 0.0,
        "lr": 1e-3,
        "lag": 1,
        "generated_tokens_per_s": 1.0,
        "trained_tokens_per_s": 1.0,
        "step_seconds": 0.1,
        **shaping,
    }
    line = format_log_line(m, 10)
    assert ("truncated rollouts" not in line) if shown is None else (shown in line)
