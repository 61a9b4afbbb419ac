"""Expert parallelism trains on the CPU tier: the tiny Qwen3-MoE checkpoint (4 experts, top 2)
at DP=2 with EP=2 (each rank 2 experts) equals EP=1 for the first steps, as the
TP/DP layouts do; it is bitwise deterministic, and a resume from its per-(TP, EP)-rank checkpoint
continues it exactly.

The entropy bonus and the KL penalty give every step a loss and a gradient through the experts
(the random model earns no reward, so the policy-gradient term is 0), and make the reference
model's forwards run under expert parallelism too; micro-batches of one row give each rank
several forwards per step.
"""

from __future__ import annotations

import pytest
from golden_values import read_metrics, run_training, training_command
from test_clean_endings import run
from test_exact_resume import COMPARED

from megatron.rl.models.hf.tiny import make_tiny_checkpoint

pytestmark = pytest.mark.slow

EP2 = {"expert-model-parallel-size": 2}


@pytest.fixture(scope="module")
def args(tmp_path_factory) -> dict:
    checkpoint = make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"), seed=5)
    return {
        "hf-checkpoint": checkpoint,
        "rl-forced-lag": 1,
        "train-iters": 3,
        "lr-warmup-iters": 1,
        "seq-length": 64,
        "grpo-prompts-per-step": 4,
        "grpo-group-size": 2,
        "micro-batch-size": 1,
        "seed": 1234,
        "moe-aux-loss-coeff": 0.01,
        "grpo-entropy-term-weight": 0.01,
        "grpo-kl-beta": 0.05,
    }


@pytest.fixture(scope="module")
def ep2(args) -> list[dict]:
    return run_training(2, {**args, **EP2})


def test_ep2_equals_ep1_for_the_first_steps(args, ep2):
    """Same tokens and rewards; loss, gradient norm and aux loss to float32 rounding (the
    experts' matrix products see other batches)."""
    ep1 = run_training(2, args)
    assert [m["step"] for m in ep2] == [0, 1, 2]
    for a, b in zip(ep1, ep2):
        assert b["reward_mean"] == a["reward_mean"] and b["staleness_max"] == a["staleness_max"]
        assert b["completion_tokens_mean"] == a["completion_tokens_mean"], a["step"]
        assert b["loss"] != 0.0 and b["grad_norm"] > 0.0
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4, abs=1e-6), a["step"]
        assert b["moe_aux_loss"] == pytest.approx(a["moe_aux_loss"], rel=1e-4), a["step"]


def test_ep2_reruns_are_bitwise_equal(args, ep2):
    again = run_training(2, {**args, **EP2})
    for metric in [*COMPARED, "moe_aux_loss", "moe_load_imbalance"]:
        assert [m.get(metric) for m in again] == [m.get(metric) for m in ep2], metric


def test_ep2_resume_from_its_checkpoint_continues_the_run(args, ep2, tmp_path):
    """Stopped after step 1 (``--exit-interval``): one shard per EP rank; the resume logs step 2
    as the run that was never stopped; ``--save-hf`` writes every expert."""
    save, metrics, hf = tmp_path / "ck", tmp_path / "metrics.jsonl", tmp_path / "hf"
    stopped = {**args, **EP2, "save": save, "save-interval": 1000, "metrics-file": metrics}
    proc, _ = run(training_command(2, {**stopped, "exit-interval": 2}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    shards = sorted(p.name for p in (save / "iter_0000002").glob("mp_rank_*"))
    assert shards == ["mp_rank_00_000", "mp_rank_00_001"]
    proc, _ = run(training_command(2, {**stopped, "load": save, "save-hf": hf}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = read_metrics(metrics)
    assert [m["step"] for m in resumed] == [0, 1, 2]
    for metric in COMPARED:
        assert [m.get(metric) for m in resumed] == [m.get(metric) for m in ep2], metric
    from safetensors import safe_open

    names = set()
    for path in hf.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            names.update(f.keys())
    experts = {n.split(".experts.")[1].split(".")[0] for n in names if ".experts." in n}
    assert experts == {"0", "1", "2", "3"}
