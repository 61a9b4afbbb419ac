"""CUDA-tier flags: refused on CPU (naming the flag), accepted and validated on CUDA; ``--bf16``
on both tiers; the step options the CUDA tier's policy has are accepted there, sequence packing
only without the Transformer Engine layer spec."""

from __future__ import annotations

import subprocess
import sys

from megatron.trainer.flags.parse import check


def errors_for(argv: list[str], world_size: int = 1, cuda: bool = False) -> list[str]:
    return check(argv, world_size, cuda)[1]


def test_the_distributed_optimizer_is_refused_on_cpu_by_name():
    (error,) = errors_for(["--use-distributed-optimizer"])
    assert error.startswith("--use-distributed-optimizer") and "CPU" in error


def test_bf16_and_recompute_are_accepted_on_both_tiers():
    argv = ["--bf16", "--recompute-granularity", "full"]
    assert errors_for(argv) == [] and errors_for(argv, cuda=True) == []
    args, errors = check(argv)
    assert args.training.bf16 is True and args.training.recompute_granularity == "full"


def test_pipeline_parallelism_is_refused_on_cpu():
    (error,) = errors_for(["--pipeline-model-parallel-size", "2"], world_size=2)
    assert "--pipeline-model-parallel-size 2" in error and "CPU" in error


def test_flags_default_off_and_change_nothing_on_cpu():
    args, errors = check([])
    assert args.training.bf16 is False and args.parallelism.use_distributed_optimizer is False
    assert errors == []


def test_on_cuda_they_are_accepted_and_pp_is_validated():
    argv = ["--bf16", "--use-distributed-optimizer", "--pipeline-model-parallel-size", "2"]
    assert errors_for(argv, world_size=2, cuda=True) == []
    (error,) = errors_for(
        ["--pipeline-model-parallel-size", "2", "--num-layers", "3"], world_size=2, cuda=True
    )
    assert "--num-layers (3)" in error and "--pipeline-model-parallel-size (2)" in error


def test_entry_script_refuses_the_distributed_optimizer_on_cpu_with_status_2():
    flag = "--use-distributed-optimizer"
    proc = subprocess.run(
        [sys.executable, "pretrain_grpo.py", flag], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert flag in proc.stderr and "Traceback" not in proc.stderr


def test_packing_is_refused_on_cuda_only_with_the_transformer_engine_spec(monkeypatch):
    import megatron.rl.models.gpt_spec as gpt_spec

    argv = ["--rl-use-sequence-packing"]
    monkeypatch.setattr(gpt_spec, "transformer_engine_importable", lambda: False)
    assert errors_for(argv, cuda=True) == []  # the SDPA layer spec honours the packed mask
    monkeypatch.setattr(gpt_spec, "transformer_engine_importable", lambda: True)
    assert errors_for(argv, cuda=False) == []
    (error,) = errors_for(argv, cuda=True)
    assert error.startswith(argv[0]) and "Transformer Engine" in error


def test_step_options_the_cuda_policy_has_are_accepted_on_cuda():
    argv = [
        "--grpo-entropy-term-weight",
        "0.01",
        "--grpo-iterations",
        "2",
        "--rl-inference-logprobs-is-correction",
        "--grpo-kl-beta",
        "0.1",
    ]
    assert errors_for(argv, cuda=True) == []
