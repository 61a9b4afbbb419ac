"""tools/benchmarks/matmul_efficiency.py: the FLOP accounting behind the matmul-efficiency
fractions of RESULTS.md (a wrong count would move every fraction by the same factor)."""

from __future__ import annotations

import pytest
from megatron.core import parallel_state

from megatron.trainer import config as trainer_config
from tools.benchmarks import hf_shapes, matmul_efficiency


def test_matmul_macs_per_token_of_the_1m_llama_shape(single_rank_world, tmp_path):
    """Hidden 128, 5 layers, 4 heads (MHA), SwiGLU 352, untied output over 384 padded rows:
    the linear layers and the output layer, no embeddings or norms."""
    parallel_state.initialize_model_parallel()
    ckpt = hf_shapes.write_checkpoint("1m", tmp_path / "llama-1m")
    args = hf_shapes.trainer_args(ckpt, 64)
    model = hf_shapes.load_ours(args, trainer_config.tokenizer(args).vocab_size)
    qkv, proj, fc1, fc2 = 3 * 128 * 128, 128 * 128, 2 * 352 * 128, 128 * 352
    output = 384 * 128
    assert matmul_efficiency.matmul_params(model) == 5 * (qkv + proj + fc1 + fc2) + output
    assert sum(p.numel() for p in model.parameters()) == 1_103_232  # as RESULTS.md reports


@pytest.mark.parametrize(
    "backward, flops_per_pass",
    [
        pytest.param(False, 2 * 2 * (4 * 3 + 5 * 4), id="forward-one-gemm-per-weight"),
        pytest.param(True, 3 * 2 * 2 * (4 * 3 + 5 * 4), id="backward-adds-two-gemms"),
    ],
)
def test_matmul_rate_is_flops_of_the_passes_over_cpu_time(monkeypatch, backward, flops_per_pass):
    """Shapes (4, 3) and (5, 4) at 2 rows; a clock that ticks 1 s a reading: the start (0 s),
    the check after 3 passes (1 s, past the 0 s budget) and the end (2 s) -> 3 passes in 2 s."""
    ticks = iter(range(100))
    monkeypatch.setattr(matmul_efficiency.time, "thread_time", lambda: float(next(ticks)))
    rate = matmul_efficiency.matmul_rate([(4, 3), (5, 4)], rows=2, backward=backward, seconds=0)
    assert rate == pytest.approx(3 * flops_per_pass / 2)
