"""The config tree (``megatron/trainer/flags``): each option is declared once, in one section, and
everything else is derived from that declaration: the parser, the run config the parse returns
(frozen), the library configs' values, the resume check and the documentation."""

from __future__ import annotations

import dataclasses

import pytest

from megatron.rl.eval.runner import EvalConfig
from megatron.rl.grpo.aggregation import LossAggregation
from megatron.rl.grpo.importance import ImportanceConfig
from megatron.rl.grpo.loss import GRPOLossConfig
from megatron.rl.grpo.off_policy_mask import OffPolicyMask
from megatron.rl.rollout.generator import RolloutConfig
from megatron.trainer import config
from megatron.trainer.flags.option import dest_of, options
from megatron.trainer.flags.parse import build_parser, check, parse_args
from megatron.trainer.flags.rollouts import Rollouts
from megatron.trainer.flags.run import SECTIONS, RunConfig, locations, resume_options

LIBRARY_FIELDS = [
    # (library config, field, the option whose value it takes)
    (RolloutConfig, "forced_lag", "--rl-forced-lag"),
    (RolloutConfig, "groups_per_batch", "--grpo-prompts-per-step"),
    (RolloutConfig, "group_size", "--grpo-group-size"),
    (RolloutConfig, "seed", "--seed"),
    (GRPOLossConfig, "clamp_eps_lower", "--grpo-clamp-eps-lower"),
    (GRPOLossConfig, "clamp_eps_upper", "--grpo-clamp-eps-upper"),
    (ImportanceConfig, "truncation_coef", "--rl-importance-sampling-truncation-coef"),
    (ImportanceConfig, "mode", "--rl-importance-sampling-mode"),
    (ImportanceConfig, "clip_min", "--rl-importance-sampling-clip-min"),
    (LossAggregation, "mode", "--loss-agg-mode"),
    (LossAggregation, "scale_factor", "--loss-scale-factor"),
    (OffPolicyMask, "threshold", "--off-policy-mask-threshold"),
    (EvalConfig, "num_prompts", "--eval-prompts"),
    (EvalConfig, "samples_per_prompt", "--eval-samples"),
    (EvalConfig, "pass_k", "--eval-pass-k"),
    (EvalConfig, "correct_threshold", "--eval-correct-threshold"),
    (EvalConfig, "seed", "--seed"),
]


@pytest.mark.parametrize(
    "cls, name, flag", LIBRARY_FIELDS, ids=[f"{c.__name__}.{n}" for c, n, _ in LIBRARY_FIELDS]
)
def test_the_library_configs_declare_no_second_default(cls, name, flag):
    """The option's default is declared in the tree only: the library field has none."""
    (f,) = [f for f in dataclasses.fields(cls) if f.name == name]
    assert f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    assert dest_of(flag) in locations() or flag.startswith("--rl-importance")


def test_the_library_configs_take_the_trees_defaults():
    cfg, errors = check([])
    assert errors == []
    rollout, loss = config.rollout_config(cfg), config.loss_config(cfg)
    evaluation = config.eval_config(cfg)
    assert (rollout.forced_lag, rollout.groups_per_batch, rollout.group_size, rollout.seed) == (
        Rollouts.forced_lag,
        cfg.grpo.prompts_per_step,
        cfg.grpo.group_size,
        cfg.training.seed,
    )
    assert (loss.clamp_eps_lower, loss.clamp_eps_upper) == (0.2, 0.28)
    assert (loss.policy_loss, loss.off_policy_mask) == ("vanilla", None)
    assert loss.aggregation == LossAggregation("token-mean", None)
    assert (evaluation.num_prompts, evaluation.samples_per_prompt, evaluation.pass_k) == (
        32,
        8,
        (1,),
    )
    with_is, _ = check(["--rl-inference-logprobs-is-correction"])
    assert config.step_config(with_is, 21).importance == ImportanceConfig.tis(1.0)


def test_every_option_is_declared_once_with_help_and_a_flag_of_its_own():
    flags, fields, primaries = [], [], []
    for name, section in SECTIONS:
        for f, declared, flag in options(section):
            assert declared.help.strip().endswith((".", ")")), flag
            flags += [flag, *declared.aliases]
            primaries.append(flag)
            fields.append((name, f.name))
    assert len(flags) == len(set(flags)) and len(fields) == len(set(fields))
    parser_flags = [s for a in build_parser()._actions for s in a.option_strings]
    assert set(flags) <= set(parser_flags)
    assert sorted(locations()) == sorted({dest_of(f) for f in primaries})


def test_the_parse_returns_a_frozen_run_config_and_variants_are_new_objects():
    cfg = parse_args(["--rl-forced-lag", "2", "--seq-length", "48", "--rl-default-max-tokens", "8"])
    assert isinstance(cfg, RunConfig)
    assert (cfg.rollouts.forced_lag, cfg.model.seq_length) == (2, 48)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rollouts.forced_lag = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.world_size = 2  # type: ignore[misc]
    variant = cfg.with_flags(rl_forced_lag=3, grpo_kl_beta=0.1)
    assert variant.rollouts.forced_lag == 3 and variant.grpo.weight("--grpo-kl-beta") == 0.1
    assert cfg.rollouts.forced_lag == 2 and cfg.grpo.weight("--grpo-kl-beta") == 0.0
    with pytest.raises(AttributeError, match="no option"):
        cfg.with_flags(rl_forced_lagg=1)


def test_the_resume_options_are_the_ones_declared_resume():
    flags = {flag for _, flag, _ in resume_options()}
    assert flags == {
        "--rl-forced-lag",
        "--rl-submission-granularity",
        "--rl-consumption-granularity",
        "--rl-generation-lag",
        "--rl-max-inflight-requests",
        "--rl-inference-tensor-model-parallel-size",
        "--rl-inference-pipeline-model-parallel-size",
        "--rl-inference-expert-model-parallel-size",
        "--rl-inference-expert-tensor-model-parallel-size",
        "--refit-mode",
        "--rl-inference-replicas",
        "--grpo-prompts-per-step",
        "--grpo-group-size",
        "--seed",
        "--num-layers",
        "--hidden-size",
        "--num-attention-heads",
        "--ffn-hidden-size",
        "--num-experts",
        "--moe-router-topk",
        "--grpo-filter-groups-with-same-reward",
        "--grpo-max-generation-rounds",
        "--val-split-fraction",
        "--lora-rank",
        "--lora-alpha",
        "--lora-use-rslora",
        "--lora-target-modules",
        "--distill-coef",
        "--distill-topk-logits-k",
    }
