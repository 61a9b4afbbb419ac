"""CUDA-tier flags: refused on CPU (naming the flag), refused on CUDA until the training loop
uses the tier, validated on CUDA once it does."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron.training import arguments
from megatron.training.arguments import build_parser, validate_args


def errors_for(argv: list[str], world_size: int = 1, cuda: bool = False) -> list[str]:
    return validate_args(build_parser().parse_args(argv), world_size, cuda)


@pytest.mark.parametrize("flag", ["--bf16", "--use-distributed-optimizer"])
def test_cuda_only_flags_are_refused_on_cpu_by_name(flag):
    (error,) = errors_for([flag])
    assert error.startswith(flag) and "CPU" in error


def test_pipeline_parallelism_is_refused_on_cpu():
    (error,) = errors_for(["--pipeline-model-parallel-size", "2"], world_size=2)
    assert "--pipeline-model-parallel-size 2" in error and "CPU" in error


def test_flags_default_off_and_change_nothing_on_cpu():
    args = build_parser().parse_args([])
    assert args.bf16 is False and args.use_distributed_optimizer is False
    assert validate_args(args, 1, cuda=False) == []


@pytest.mark.parametrize("flag", ["--bf16", "--use-distributed-optimizer"])
def test_on_cuda_they_wait_for_the_training_loop_to_use_the_tier(flag):
    assert not arguments.TRAINING_LOOP_USES_TIERS
    (error,) = errors_for([flag], cuda=True)
    assert error.startswith(flag) and "tiers.py" in error


def test_on_cuda_with_the_tier_wired_they_are_accepted_and_pp_is_validated(monkeypatch):
    monkeypatch.setattr(arguments, "TRAINING_LOOP_USES_TIERS", True)
    argv = ["--bf16", "--use-distributed-optimizer", "--pipeline-model-parallel-size", "2"]
    assert errors_for(argv, world_size=2, cuda=True) == []
    (error,) = errors_for(
        ["--pipeline-model-parallel-size", "2", "--num-layers", "3"], world_size=2, cuda=True
    )
    assert "--num-layers (3)" in error and "--pipeline-model-parallel-size (2)" in error


def test_entry_script_refuses_bf16_on_cpu_with_status_2():
    proc = subprocess.run(
        [sys.executable, "pretrain_grpo.py", "--bf16"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "--bf16" in proc.stderr and "Traceback" not in proc.stderr
