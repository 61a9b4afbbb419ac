"""tools/bench_cuda.py: the FLOP count behind the MFU, option checks, and (gpu) a short run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from grpo_testing.distributed import env_without_world

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("bench_cuda", ROOT / "tools" / "bench_cuda.py")
bench_cuda = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_cuda)


def test_flops_per_token_of_a_125m_gpt_is_about_six_times_its_weights():
    flops = bench_cuda.training_flops_per_token(12, 768, 3072, 12, 12, 1024, 50304)
    weights = 12 * 12 * 768**2 + 768 * 50304  # ~124M matmul weights incl. the output layer
    attention = 3 * 12 * 2 * 768 * 1024
    assert flops == pytest.approx(6 * weights + attention)
    assert 0.7e9 < flops < 0.85e9


def test_a_gated_mlp_has_three_matrices():
    plain = bench_cuda.training_flops_per_token(1, 10, 20, 1, 1, 0, 0)
    gated = bench_cuda.training_flops_per_token(1, 10, 20, 1, 1, 0, 0, gated=True)
    assert gated - plain == 3 * 2 * 10 * 20  # one more 10 x 20 matrix, 2 FLOPs a weight, x3


def test_decode_reads_every_weight_per_step_and_each_requests_cache_so_far():
    # 2 steps, 3 requests with 4-token prompts: 3 x (4 + 5) positions, each 2 x 1 layer x 2 kv
    # heads x 8 channels x 2 bytes = 64 bytes; plus the 1000 weight bytes twice
    needed = bench_cuda.decode_bytes(1000, 3, 4, 2, 1, 2, 8, kv_bytes=2)
    assert needed == 2 * 1000 + 3 * (4 + 5) * 64


def test_grouped_query_attention_shrinks_the_kv_projection():
    mha = bench_cuda.training_flops_per_token(2, 64, 256, 4, 4, 32, 100)
    gqa = bench_cuda.training_flops_per_token(2, 64, 256, 4, 1, 32, 100)
    assert mha - gqa == pytest.approx(3 * 2 * 2 * (2 * 64 * 48))


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.4),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("Tesla T4", None),
    ],
)
def test_peak_by_device_name(name, peak):
    assert bench_cuda.peak_tflops_for(name) == peak


def test_inconsistent_lengths_are_refused():
    with pytest.raises(SystemExit):
        bench_cuda.parse(["--seq-length", "128", "--prompt-len", "64", "--gen-tokens", "128"])


def test_synthetic_batch_has_loss_on_generated_tokens_only():
    batch = bench_cuda.synthetic_batch(4, 16, 6, 50)
    assert batch.input_ids.shape == (4, 16)
    assert batch.num_loss_tokens == 4 * (16 - 5)
    assert torch_equal(batch.input_ids[:, 1:], batch.target_ids[:, :-1])


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


@pytest.mark.gpu
def test_a_short_run_reports_throughput_and_mfu():
    proc = subprocess.run(
        [
            sys.executable,
            "tools/bench_cuda.py",
            "--num-layers",
            "2",
            "--hidden-size",
            "128",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "256",
            "--prompt-len",
            "32",
            "--gen-tokens",
            "32",
            "--gen-requests",
            "8",
            "--batch-size",
            "8",
            "--micro-batch-size",
            "4",
            "--train-steps",
            "2",
            "--warmup-steps",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env_without_world(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout[proc.stdout.index("{") :])
    assert out["generated_tokens_per_s"] > 0 and out["train_tokens_per_s"] > 0
    assert "DynamicInferenceEngine" in out["tier"]
