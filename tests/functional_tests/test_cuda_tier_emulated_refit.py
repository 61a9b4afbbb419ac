"""Collocated refit on the CUDA tier, emulated on the CPU (``grpo_testing/emulated_cuda_train.py``):
``--rl-inference-tensor-model-parallel-size`` builds megatron-core's dynamic engine on an inference
copy with process groups of its own, refit over the training TP group after every optimizer step
and verified against the trained weights (``--rl-verify-model-weights-swap``).

Without a GPU this is what shows the copy, its engine and the refit are wired into the CUDA tier;
the collectives run on gloo here and on NCCL on a GPU.
"""

from __future__ import annotations

import pytest
from golden_values import TOLERANCES, run_training
from test_cuda_tier_emulated import BASE, EMULATED, assert_same_run

DETERMINISTIC = list(TOLERANCES)  # every guarded metric; timings are not
FLAG = "rl-inference-tensor-model-parallel-size"
TP2 = {**BASE, "rl-forced-lag": 0, "tensor-model-parallel-size": 2}
COPY = {"rl-verify-model-weights-swap": True}


@pytest.fixture(scope="module")
def plain_tp2() -> list[dict]:
    """The emulated CUDA tier at TP=2, generating on the trained model itself."""
    return run_training(2, TP2, script=EMULATED)


@pytest.mark.slow  # the CPU tier's twin runs in CI (test_pretrain_grpo.py)
def test_a_copy_at_the_training_layout_generates_what_the_trained_model_does(plain_tp2):
    """Each rank copies its own shards (nothing is sent): every metric equal, not close."""
    refit = run_training(2, {**TP2, FLAG: 2, **COPY}, script=EMULATED)
    assert [{k: m[k] for k in DETERMINISTIC} for m in refit] == [
        {k: m[k] for k in DETERMINISTIC} for m in plain_tp2
    ]
    assert all(m["refit/bytes_received"] == 0 < m["refit/bytes_written"] for m in refit)


def test_two_tp1_copies_of_a_tp2_run_sample_the_same_tokens(plain_tp2):
    """Two TP=1 replicas of megatron-core's engine, each on a whole copy gathered from the TP=2
    shards: the same tokens (rewards), losses to float rounding, the lag exact."""
    refit = run_training(2, {**TP2, FLAG: 1, **COPY}, script=EMULATED)
    assert_same_run(plain_tp2, refit)
    for m in refit:  # each rank gathers the other's half of each split weight, writes them whole
        assert m["refit/bytes_written"] > m["refit/bytes_received"] > 0
        assert 0 <= m["refit/unchanged_bf16_share"] < 1


@pytest.mark.slow
def test_a_bf16_copy_is_refit_from_the_bf16_weights():
    """Under ``--bf16`` the copy is a ``Float16Module`` like the trained model: half the bytes
    of float32, verified after every refit (a mismatch would stop the run)."""
    fp32 = run_training(2, {**TP2, FLAG: 1, **COPY, "train-iters": 2}, script=EMULATED)
    bf16 = run_training(
        2, {**TP2, FLAG: 1, **COPY, "train-iters": 2, "bf16": True}, script=EMULATED
    )
    for a, b in zip(fp32, bf16):
        assert b["refit/bytes_written"] * 2 == a["refit/bytes_written"]
        assert b["staleness_max"] == a["staleness_max"] == 0
