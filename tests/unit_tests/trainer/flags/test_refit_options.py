"""The collocated refit's options (``--rl-inference-tensor-model-parallel-size``,
``--refit-method``): off by default, the engine's replicas from the inference layout, refusals
that name the flags."""

from __future__ import annotations

import pytest

from megatron.rl.tokenizer import CharTokenizer
from megatron.trainer.config import pipeline_config
from megatron.trainer.flags.parse import check
from megatron.trainer.flags.refit import FLAG

TP2 = ["--tensor-model-parallel-size", "2"]


def test_without_the_flag_generation_runs_on_the_trained_model():
    args, errors = check(TP2 + ["--refit-method", "gloo"], 2, False)  # accepted, no effect
    assert errors == []
    assert args.parallelism.rl_inference_tensor_model_parallel_size is None


def test_two_tp1_replicas_of_a_tp2_run_split_the_engine_slots():
    argv = TP2 + [FLAG, "1", "--inference-max-requests", "8", "--refit-mode", "collocated"]
    args, errors = check(argv, 2, False)
    assert errors == []
    config = pipeline_config(args, 1, CharTokenizer())
    assert config.inference_tp == 1 and config.engine.max_requests == 4  # 8 slots, 2 replicas


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
            [FLAG, "1", "--num-experts", "4"],
            1,
            False,
            f"{FLAG} supports dense models only",
            id="moe",
        ),
        pytest.param(
            [FLAG, "1"], 1, True, f"{FLAG} is implemented on the CPU tier only", id="cuda"
        ),
        pytest.param(
            ["--refit-method", "nccl"], 1, False, "--refit-method nccl needs CUDA", id="nccl-on-cpu"
        ),
        pytest.param([FLAG, "0"], 1, False, f"{FLAG} must be >= 1, got 0", id="zero"),
        pytest.param(
            ["--refit-mode", "non-collocated"],
            2,
            False,
            "--refit-mode non-collocated (inference on ranks of its own) is not implemented",
            id="non-collocated",
        ),
    ],
)
def test_refusals_name_the_flags(argv, world, cuda, message):
    _, errors = check(["--num-attention-heads", "4"] + argv, world, cuda)
    assert any(message in e for e in errors), errors
