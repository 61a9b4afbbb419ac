"""The refit options (``--rl-inference-tensor-model-parallel-size``, ``--refit-mode``,
``--refit-method``, ``--rl-delta-refit``): off by default, the engine's replicas from the
inference layout, the non-collocated split of the world, refusals that name the flags."""

from __future__ import annotations

import pytest

from megatron.rl.tokenizer import CharTokenizer
from megatron.trainer.config import pipeline_config
from megatron.trainer.flags.parse import check
from megatron.trainer.flags.refit import FLAG, inference_run_config

TP2 = ["--tensor-model-parallel-size", "2"]


def test_without_the_flag_generation_runs_on_the_trained_model():
    for cuda in (False, True):  # Megatron-LM's default method: accepted, no effect
        args, errors = check(TP2 + ["--refit-method", "gloo"], 2, cuda)
        assert errors == []
    assert args.parallelism.rl_inference_tensor_model_parallel_size is None


def test_two_tp1_replicas_of_a_tp2_run_split_the_engine_slots():
    argv = TP2 + [FLAG, "1", "--inference-max-requests", "8", "--refit-mode", "collocated"]
    args, errors = check(argv, 2, False)
    assert errors == []
    config = pipeline_config(args, 1, CharTokenizer())
    assert config.inference_tp == 1 and config.engine.max_requests == 4  # 8 slots, 2 replicas


def test_collocated_refit_on_cuda_is_a_copy_at_the_inference_layout_over_nccl():
    argv = TP2 + [FLAG, "1", "--inference-max-requests", "8"]
    for method in ([], ["--refit-method", "nccl"]):
        args, errors = check(argv + method, 2, True)
        assert errors == []
        config = pipeline_config(args, 1, CharTokenizer())
        assert config.inference_tp == 1 and config.engine.max_requests == 4


def test_an_moe_copy_holds_every_expert_at_the_inference_tp():
    """Megatron-LM's expert flags of the copy at the values implemented: EP 1, expert TP = TP."""
    argv = TP2 + [
        "--num-experts",
        "4",
        "--disable-bias-linear",
        "--expert-model-parallel-size",
        "2",
    ]
    argv += [FLAG, "1"]
    argv += ["--rl-inference-expert-model-parallel-size", "1"]
    argv += ["--rl-inference-expert-tensor-model-parallel-size", "1"]
    for cuda in (False, True):
        args, errors = check(argv, 4, cuda)
        assert errors == []
        assert pipeline_config(args, 1, CharTokenizer()).inference_tp == 1


def test_a_pipeline_run_generates_on_whole_copies():
    """Trained in two stages on CUDA: each rank's copy is one whole stage at the inference TP."""
    argv = ["--pipeline-model-parallel-size", "2", "--num-layers", "2", FLAG, "1"]
    args, errors = check(argv + ["--rl-inference-pipeline-model-parallel-size", "1"], 2, True)
    assert errors == []
    assert pipeline_config(args, 1, CharTokenizer()).inference_tp == 1


def test_non_collocated_splits_the_world_into_training_and_inference_ranks():
    """Megatron-LM's convention: the last --rl-inference-tensor-model-parallel-size ranks (one
    inference replica) only generate; the rest train, and the layout checks are theirs."""
    argv = TP2 + [FLAG, "1", "--refit-mode", "non-collocated", "--inference-max-requests", "6"]
    argv += ["--rl-forced-lag", "1"]  # the least lag generation one collection behind has
    args, errors = check(argv, 5, False)
    assert errors == []
    assert (args.world_size, args.inference_ranks, args.data_parallel_size) == (4, 1, 2)
    inference = inference_run_config(args)
    assert inference.parallelism.tensor_model_parallel_size == 1 and inference.world_size == 1
    config = pipeline_config(inference, 1, CharTokenizer())
    assert config.inference_tp is None and config.engine.max_requests == 6  # one replica
    replicas = argv + ["--rl-inference-replicas", "2"]  # the last 2 ranks: two TP=1 replicas
    args, errors = check(replicas, 6, False)
    assert errors == [] and (args.world_size, args.inference_ranks) == (4, 2)
    inference = inference_run_config(args)
    assert (inference.parallelism.tensor_model_parallel_size, inference.world_size) == (1, 2)
    assert pipeline_config(inference, 2, CharTokenizer()).engine.max_requests == 3  # 6 / 2
    _, errors = check(["--refit-mode", "non-collocated", "--rl-forced-lag", "1"], 2, True)  # CUDA
    assert errors == []
    _, errors = check(TP2 + ["--refit-mode", "non-collocated"], 5, False)  # 3 training ranks
    assert any(
        "world size 3 must be divisible by --tensor-model-parallel-size" in e for e in errors
    )


@pytest.mark.parametrize(
    "argv, world, cuda, message",
    [
        pytest.param(
            [FLAG, "2"], 3, False, f"world size 3 must be divisible by {FLAG} (2)", id="world"
        ),
        pytest.param(
            [FLAG, "3"],
            3,
            False,
            f"--num-attention-heads (4) must be divisible by {FLAG} (3)",
            id="heads",
        ),
        pytest.param(
            TP2 + [FLAG, "1", "--inference-max-requests", "3"],
            2,
            False,
            "--inference-max-requests (3) must be divisible by the 2 inference replicas",
            id="slots",
        ),
        pytest.param(
            [FLAG, "1", "--lora-rank", "4"],
            1,
            False,
            f"{FLAG} copies whole weights: with --lora-rank",
            id="lora",
        ),
        pytest.param(
            ["--refit-mode", "non-collocated", "--num-experts", "4"],
            2,
            False,
            "--refit-mode non-collocated supports dense models only",
            id="non-collocated-moe",
        ),
        pytest.param(
            [FLAG, "1", "--num-experts", "4", "--moe-grouped-gemm"],
            1,
            True,
            f"{FLAG} with --moe-grouped-gemm: the refit copies megatron-core's sequential",
            id="moe-grouped-gemm",
        ),
        pytest.param(
            TP2 + [FLAG, "2", "--num-experts", "4", "--moe-ffn-hidden-size", "5"],
            2,
            False,
            f"--moe-ffn-hidden-size (5) must be divisible by {FLAG} (2)",
            id="moe-ffn",
        ),
        pytest.param(
            [FLAG, "1", "--num-experts", "4", "--rl-inference-expert-model-parallel-size", "2"],
            2,
            False,
            "--rl-inference-expert-model-parallel-size 2: an inference copy holds every expert "
            "(1, the only size implemented)",
            id="copy-ep",
        ),
        pytest.param(
            TP2 + [FLAG, "1", "--rl-inference-expert-tensor-model-parallel-size", "2"],
            2,
            False,
            "--rl-inference-expert-tensor-model-parallel-size 2: the copy's experts are split "
            f"over its {FLAG} (1) ranks (1, the only size implemented)",
            id="copy-etp",
        ),
        pytest.param(
            ["--rl-inference-expert-model-parallel-size", "1"],
            1,
            False,
            f"--rl-inference-expert-model-parallel-size describe the copy of {FLAG}: set it too",
            id="copy-ep-without-copy",
        ),
        pytest.param(
            [FLAG, "1", "--pipeline-model-parallel-size", "2", "--num-layers", "2"]
            + ["--num-experts", "4", "--expert-model-parallel-size", "2"],
            4,
            True,
            f"{FLAG} with --pipeline-model-parallel-size 2 and --expert-model-parallel-size 2: "
            "a copy gathers pipeline stages or expert-parallel ranks, not both",
            id="cuda-pipeline-and-experts",
        ),
        pytest.param(
            [FLAG, "1", "--rl-inference-pipeline-model-parallel-size", "2"],
            2,
            True,
            "--rl-inference-pipeline-model-parallel-size 2: an inference copy is one whole stage "
            "(1, the only size implemented)",
            id="copy-pp",
        ),
        pytest.param(
            [FLAG, "1", "--refit-method", "gloo"],
            1,
            True,
            f"--refit-method gloo with {FLAG}: a collocated refit on CUDA gathers each weight",
            id="cuda-collocated-gloo",
        ),
        pytest.param(
            ["--refit-mode", "non-collocated", "--refit-method", "nccl"],
            2,
            True,
            "--refit-method nccl with --refit-mode non-collocated: the weights travel over gloo",
            id="cuda-non-collocated-nccl",
        ),
        pytest.param(
            ["--refit-method", "nccl"], 1, False, "--refit-method nccl needs CUDA", id="nccl-on-cpu"
        ),
        pytest.param([FLAG, "0"], 1, False, f"{FLAG} must be >= 1, got 0", id="zero"),
        pytest.param(
            ["--refit-mode", "non-collocated"],
            1,
            False,
            "--refit-mode non-collocated: the world of 1 ranks leaves none to train",
            id="non-collocated-world",
        ),
        pytest.param(
            ["--refit-mode", "non-collocated", FLAG, "2"],
            2,
            False,
            "--refit-mode non-collocated: the world of 2 ranks leaves none to train beside the 2",
            id="non-collocated-tp",
        ),
        pytest.param(
            ["--refit-mode", "non-collocated", "--lora-rank", "4"],
            2,
            False,
            "--refit-mode non-collocated copies whole weights: with --lora-rank",
            id="non-collocated-lora",
        ),
        pytest.param(
            ["--rl-inference-replicas", "2"],
            2,
            False,
            "--rl-inference-replicas needs --refit-mode non-collocated",
            id="replicas-collocated",
        ),
        pytest.param(
            ["--refit-mode", "non-collocated", "--rl-inference-replicas", "2"],
            2,
            False,
            "leaves none to train beside the 2 inference ranks (2 replicas of",
            id="replicas-world",
        ),
        pytest.param(
            ["--refit-mode", "non-collocated", "--rl-inference-replicas", "2"]
            + ["--inference-max-requests", "5"],
            3,
            False,
            "--inference-max-requests (5) must be divisible by the 2 inference replicas",
            id="replicas-slots",
        ),
        pytest.param(
            ["--rl-delta-refit"],
            1,
            False,
            "--rl-delta-refit needs --refit-mode non-collocated",
            id="delta-collocated",
        ),
        pytest.param(
            ["--refit-mode", "non-collocated", "--rl-forced-lag", "0"],
            2,
            False,
            "--refit-mode non-collocated with --rl-forced-lag 0: generation on ranks of its own "
            "runs one collection behind training, so its lag is at least 1",
            id="non-collocated-lag-0",
        ),
    ],
)
def test_refusals_name_the_flags(argv, world, cuda, message):
    _, errors = check(["--num-attention-heads", "4"] + argv, world, cuda)
    assert any(message in e for e in errors), errors
