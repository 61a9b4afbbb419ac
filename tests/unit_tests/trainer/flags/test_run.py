"""``flags.resolve.resolve``: derived values, and every bad combination of options reported
at once, each message naming the flag(s) at fault."""

from __future__ import annotations

import pytest

from megatron.trainer.flags.parse import check


def errors_for(argv: list[str], world_size: int = 1, cuda: bool = False) -> list[str]:
    return check(argv, world_size, cuda)[1]


def test_defaults_are_valid_and_derived_values_are_filled():
    args, errors = check([], 1, False)
    assert errors == []
    assert args.training.global_batch_size == args.grpo.prompts_per_step * args.grpo.group_size
    assert args.model.ffn_hidden_size == 4 * args.model.hidden_size
    assert args.model.max_position_embeddings == args.model.seq_length
    assert args.data_parallel_size == 1
    assert args.training.min_lr == pytest.approx(args.training.lr / 10)


def test_the_default_min_lr_follows_a_small_lr():
    """A fine-tuning --lr below the default's floor needs no --min-lr of its own."""
    args, errors = check(["--lr", "2e-5"], 1, False)
    assert errors == []
    assert args.training.min_lr == pytest.approx(2e-6)


@pytest.mark.parametrize(
    "argv, world_size, flag",
    [
        pytest.param(["--rl-forced-lag", "-1"], 1, "--rl-forced-lag", id="negative-lag"),
        pytest.param(["--grpo-group-size", "1"], 1, "--grpo-group-size", id="group-of-one"),
        pytest.param(
            ["--global-batch-size", "48"], 1, "--global-batch-size", id="gbs-not-rollouts"
        ),
        pytest.param(["--micro-batch-size", "24"], 1, "--micro-batch-size", id="gbs-not-divisible"),
        pytest.param(
            ["--micro-batch-size", "64"], 2, "data-parallel size", id="gbs-not-divisible-dp"
        ),
        pytest.param(
            ["--pipeline-model-parallel-size", "2"],
            2,
            "--pipeline-model-parallel-size",
            id="pp-on-cpu",
        ),
        pytest.param(
            ["--tensor-model-parallel-size", "2"],
            3,
            "--tensor-model-parallel-size",
            id="world-not-divisible-by-tp",
        ),
        pytest.param(
            ["--tensor-model-parallel-size", "3"],
            3,
            "--num-attention-heads",
            id="heads-not-divisible-by-tp",
        ),
        pytest.param(["--hidden-size", "30"], 1, "--hidden-size", id="hidden-not-divisible"),
        pytest.param(
            ["--seq-length", "64", "--max-position-embeddings", "32"],
            1,
            "--max-position-embeddings",
            id="seq-longer-than-positions",
        ),
        pytest.param(["--min-lr", "1"], 1, "--min-lr", id="min-lr-above-lr"),
        pytest.param(["--lr-warmup-iters", "-1"], 1, "--lr-warmup-iters", id="negative-warmup"),
        pytest.param(
            ["--grpo-clamp-eps-lower", "1.5"],
            1,
            "--grpo-clamp-eps-lower",
            id="eps-lower-out-of-range",
        ),
        pytest.param(["--rl-default-top-p", "1.5"], 1, "--rl-default-top-p", id="top-p-above-1"),
        pytest.param(["--rl-default-top-k", "-2"], 1, "--rl-default-top-k", id="top-k-below-off"),
        pytest.param(
            ["--rl-default-max-tokens", "40"],
            1,
            "--rl-default-max-tokens",
            id="max-tokens-beyond-seq-length",
        ),
        pytest.param(
            ["--inference-max-requests", "63"],
            2,
            "--inference-max-requests",
            id="requests-not-divisible-by-dp",
        ),
        pytest.param(["--env-config", "/nonexistent.yaml"], 1, "--env-config", id="missing-env"),
        pytest.param(
            ["--save-interval", "5"],
            1,
            "--save-interval needs --save",
            id="save-interval-without-save",
        ),
        pytest.param(["--load", "/nonexistent-dir"], 1, "--load", id="missing-load-dir"),
        pytest.param(["--train-iters", "0"], 1, "--train-iters", id="zero-iters"),
        pytest.param(
            ["--malloc-mmap-threshold-kib", "0"], 1, "--malloc-mmap-threshold-kib", id="zero-mmap"
        ),
        pytest.param(
            ["--malloc-mmap-threshold-kib", "1024", "--cpu-allocator", "jemalloc"],
            1,
            "--malloc-mmap-threshold-kib is glibc's: it does nothing with --cpu-allocator jemalloc",
            id="mmap-with-jemalloc",
        ),
        pytest.param(
            ["--malloc-mmap-threshold-kib", "32769"],
            1,
            "--malloc-mmap-threshold-kib",
            id="mmap-above-glibc-max",
        ),
        pytest.param(
            ["--rl-reward-wait-steps", "-1"], 1, "--rl-reward-wait-steps", id="negative-budget"
        ),
        pytest.param(
            ["--num-experts", "4", "--moe-router-topk", "5", "--disable-bias-linear"],
            1,
            "--moe-router-topk",
            id="topk-above-experts",
        ),
        pytest.param(
            ["--num-experts", "4", "--moe-router-topk", "1", "--disable-bias-linear"],
            1,
            "--moe-router-pre-softmax",
            id="top1-without-pre-softmax",
        ),
        pytest.param(
            ["--moe-ffn-hidden-size", "32"], 1, "needs --num-experts", id="moe-no-experts"
        ),
        pytest.param(["--num-experts", "4"], 1, "--disable-bias-linear", id="experts-with-biases"),
        pytest.param(
            ["--expert-model-parallel-size", "2"], 2, "needs --num-experts", id="ep-no-experts"
        ),
        pytest.param(
            ["--num-experts", "3", "--disable-bias-linear", "--expert-model-parallel-size", "2"],
            2,
            "divisible by --expert-model-parallel-size",
            id="experts-not-divisible-by-ep",
        ),
        pytest.param(
            ["--num-experts", "4", "--disable-bias-linear", "--expert-model-parallel-size", "4"],
            2,
            "must divide the data-parallel size",
            id="ep-above-dp",
        ),
        pytest.param(
            ["--num-experts", "4", "--disable-bias-linear", "--moe-grouped-gemm"],
            1,
            "--moe-grouped-gemm",
            id="grouped-gemm-on-cpu",
        ),
        pytest.param(
            ["--rl-reward-wait-steps", "8", "--no-rl-deterministic-schedule"],
            1,
            "--no-rl-deterministic-schedule",
            id="budget-without-deterministic-schedule",
        ),
    ],
)
def test_bad_flags_are_reported_by_name(argv, world_size, flag):
    errors = errors_for(argv, world_size)
    assert errors, "expected a validation error"
    assert any(flag in e for e in errors), errors


def test_expert_parallelism_trains_on_cpu():
    argv = ["--num-experts", "4", "--disable-bias-linear", "--expert-model-parallel-size", "2"]
    assert errors_for(argv, 2) == []


def test_every_problem_is_reported_at_once():
    errors = errors_for(["--rl-forced-lag", "-1", "--grpo-group-size", "1", "--lr", "0"])
    assert len(errors) >= 3


@pytest.mark.parametrize(
    "argv, flag",
    [
        pytest.param(["--grpo-kl-beta", "-0.1"], "--grpo-kl-beta", id="negative-kl-beta"),
        pytest.param(
            ["--ref-load", "/nonexistent-dir"], "--ref-load needs --grpo-kl-beta", id="ref-no-kl"
        ),
        pytest.param(
            ["--grpo-kl-beta", "0.1", "--ref-load", "/nonexistent-dir"],
            "--ref-load: no such directory",
            id="missing-ref-dir",
        ),
        pytest.param(
            ["--grpo-entropy-term-weight", "nan"], "--grpo-entropy-term-weight", id="entropy-nan"
        ),
        pytest.param(["--grpo-iterations", "0"], "--grpo-iterations", id="zero-iterations"),
        pytest.param(
            ["--grpo-max-generation-rounds", "2"],
            "--grpo-max-generation-rounds > 1 needs --grpo-filter-groups-with-same-reward",
            id="rounds-without-filter",
        ),
        pytest.param(
            ["--grpo-filter-groups-with-same-reward", "--grpo-max-generation-rounds", "0"],
            "--grpo-max-generation-rounds",
            id="zero-rounds",
        ),
        pytest.param(
            ["--rl-importance-sampling-truncation-coef", "2"],
            "--rl-importance-sampling-truncation-coef needs --rl-inference-logprobs-is-correction",
            id="coef-without-correction",
        ),
        pytest.param(
            [
                "--rl-inference-logprobs-is-correction",
                "--rl-importance-sampling-truncation-coef",
                "0",
            ],
            "--rl-importance-sampling-truncation-coef must be > 0",
            id="zero-coef",
        ),
        pytest.param(
            ["--rl-seq-logprob-error-threshold", "0.9"],
            "--rl-seq-logprob-error-threshold must be >= 1",
            id="seq-error-threshold-below-one",
        ),
        pytest.param(
            ["--rl-seq-logprob-error-threshold", "inf"],
            "--rl-seq-logprob-error-threshold must be >= 1",
            id="seq-error-threshold-inf",
        ),
        pytest.param(["--eval-interval", "0"], "--eval-interval", id="zero-eval-interval"),
        pytest.param(["--eval-prompts", "0"], "--eval-prompts", id="zero-eval-prompts"),
        pytest.param(["--eval-samples", "0"], "--eval-samples", id="zero-eval-samples"),
        pytest.param(
            ["--eval-samples", "4", "--eval-pass-k", "1", "8"], "--eval-pass-k", id="k-above-n"
        ),
        pytest.param(
            ["--val-at-end", "--val-split-fraction", "1"],
            "--val-split-fraction must be in [0, 1), got 1.0",
            id="val-split-all",
        ),
        pytest.param(
            ["--val-at-end", "--val-split-fraction", "-0.1"],
            "--val-split-fraction must be in [0, 1)",
            id="val-split-negative",
        ),
        pytest.param(
            ["--val-split-fraction", "0.1"],
            "--val-split-fraction holds problems out for evaluation: give --eval-interval",
            id="val-split-without-evaluation",
        ),
        pytest.param(
            ["--val-dump-dir", "dump"],
            "--val-dump-dir needs evaluation",
            id="val-dump-without-evaluation",
        ),
    ],
)
def test_bad_algorithm_flags_are_reported_by_name(argv, flag):
    errors = errors_for(argv)
    assert any(flag in e for e in errors), errors


def test_algorithm_flags_together_are_valid(tmp_path):
    argv = [
        "--grpo-kl-beta",
        "0.05",
        "--ref-load",
        str(tmp_path),
        "--grpo-entropy-term-weight",
        "0.001",
        "--grpo-iterations",
        "2",
        "--grpo-filter-groups-with-same-reward",
        "--grpo-max-generation-rounds",
        "3",
        "--rl-inference-logprobs-is-correction",
        "--rl-importance-sampling-truncation-coef",
        "1.5",
        "--rl-use-sequence-packing",
        "--eval-interval",
        "10",
        "--eval-samples",
        "8",
        "--eval-pass-k",
        "1",
        "8",
        "--rl-forced-lag",
        "2",
        "--rl-seq-logprob-error-threshold",
        "1.5",
        "--rl-log-seq-logprob-error",
        "--val-split-fraction",
        "0.1",
        "--val-at-start",
        "--val-at-end",
        "--val-dump-dir",
        str(tmp_path / "dump"),
    ]
    assert errors_for(argv) == []


@pytest.mark.parametrize(
    "flag",
    [
        pytest.param("--val-at-start", id="at-start"),
        pytest.param("--val-at-end", id="at-end"),
        pytest.param("--eval-iters", id="eval-iters"),
    ],
)
def test_each_evaluation_flag_allows_a_validation_split(flag):
    argv = [flag, "1"] if flag == "--eval-iters" else [flag]
    assert errors_for([*argv, "--val-split-fraction", "0.2"]) == []


@pytest.mark.parametrize(
    "argv, message",
    [
        pytest.param(["--ckpt-step", "3"], "--ckpt-step needs --load", id="ckpt-step-no-load"),
        pytest.param(
            ["--rl-max-failed-rollout-fraction", "1.5"],
            "--rl-max-failed-rollout-fraction must be in [0, 1]",
            id="failed-fraction",
        ),
    ],
)
def test_fault_flags_are_validated(argv, message):
    assert any(message in e for e in errors_for(argv))


@pytest.mark.parametrize(
    "argv, world_size, message",
    [
        pytest.param(
            ["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "33"],
            2,
            "--ffn-hidden-size (33) must be divisible by --tensor-model-parallel-size (2)",
            id="ffn-not-divisible-by-tp",
        ),
        pytest.param(
            ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "3"],
            2,
            "--make-vocab-size-divisible-by (3) must be divisible by --tensor-model-parallel-size"
            " (2)",
            id="vocab-padding-not-divisible-by-tp",
        ),
        pytest.param(["--no-load-optim"], 1, "--no-load-optim needs --load", id="no-load-optim"),
        pytest.param(["--no-load-rng"], 1, "--no-load-rng needs --load", id="no-load-rng"),
        pytest.param(["--finetune"], 1, "--finetune needs --load", id="finetune"),
    ],
)
def test_conflicting_flags_are_reported_naming_both(argv, world_size, message):
    assert errors_for(argv, world_size) == [message]
