"""On-policy distillation end to end (``--distill-teacher``): the student's own weights as the
teacher give a zero gradient (both variants), and served by ``megatron.trainer.serve`` score as
the student itself.

The golden case ``distill_lag2`` (``test_pretrain_grpo.py``) guards a distilling run at forced
lag 2 (staleness exact) killed and resumed against the uninterrupted run's numbers; the checks of
the teacher's directory and tokenizer are unit tests (``test_distill_options.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from golden_values import run_training
from serving import KEY, command_env, running_server

from megatron.rl.models.hf.tiny import make_tiny_checkpoint


@pytest.mark.parametrize(
    "variant",
    [pytest.param({}, id="sampled-token"), pytest.param({"distill-topk-logits-k": 8}, id="top-k")],
)
def test_the_students_own_weights_as_teacher_give_zero_advantage_and_gradient(
    tmp_path: Path, variant
):
    model = make_tiny_checkpoint("qwen2", tmp_path / "tiny", seed=1)
    args = {
        "hf-checkpoint": model,
        "distill-teacher": model,
        "distill-coef": "only",
        "rl-forced-lag": 0,
        "train-iters": 2,
        "seed": 1234,
        **variant,
    }
    metrics = run_training(1, args)
    assert len(metrics) == 2
    for m in metrics:  # every step: the policy never moved, so the teacher still equals it
        assert m["distill/reverse_kl"] == 0.0, m["step"]
        assert m["distill/teacher_logprob"] == m["distill/student_logprob"] < 0.0
        assert 0.0 <= m["distill/argmax_mismatch"] <= 1.0
        assert m["loss"] == 0.0 and m["grad_norm"] == 0.0, m["step"]  # the same forward
        if variant:  # both sides' logprobs of the teacher's top-k ids: the same computation
            assert m["distill/topk_kl"] == 0.0, m["step"]
            assert 0.0 < m["distill/student_topk_mass"] == m["distill/teacher_topk_mass"] <= 1.0


def test_a_served_teacher_scores_the_rollouts_as_the_student_does(tmp_path: Path):
    """The student's weights served by ``megatron.trainer.serve`` (keyed) as the teacher, at
    forced lag 1: the server's logprobs are the trainer's to float rounding (its engine's forward
    against the trainer's), staleness stays exact, and no argmax is reported."""
    model = make_tiny_checkpoint("qwen2", tmp_path / "tiny", seed=1)
    key = tmp_path / "key"
    key.write_text(KEY)
    env = command_env(MEGATRON_RL_API_KEY=KEY)
    with running_server(["--hf-checkpoint", str(model)], env) as served:
        args = {
            "hf-checkpoint": model,
            "distill-teacher": served.url.removesuffix("/v1"),
            "distill-coef": "only",
            "rl-api-key-file": key,
            "rl-forced-lag": 1,
            "train-iters": 2,
            "grpo-prompts-per-step": 2,  # 8 rollouts a step: 8 requests, one at a time
            "grpo-group-size": 4,
            "micro-batch-size": 4,
            "seed": 1234,
        }
        metrics = run_training(1, args)
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:
        assert m["staleness_min"] == m["staleness_max"] == min(m["step"], 1)
        assert "distill/argmax_mismatch" not in m
    first = metrics[0]  # the student has not moved: the teacher is its own weights
    assert abs(first["distill/reverse_kl"]) < 1e-5
    assert first["distill/teacher_logprob"] == pytest.approx(first["distill/student_logprob"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    [pytest.param({}, id="sampled-token"), pytest.param({"distill-topk-logits-k": 32}, id="top-k")],
)
def test_smollm2_distills_from_its_own_rl_trained_export_with_exact_staleness(
    smollm2_checkpoint, tmp_path, variant
):
    """The real pretrained model at its real shape, bfloat16 with layer recompute: two RL steps
    exported with --save-hf are the teacher of the untrained model at forced lag 1 (the top-k
    variant through the chunked output layer: 49152 ids)."""
    pytest.importorskip("math_verify")
    shared = {
        "env-config": "examples/rl/environment_configs/arithmetic.yaml",
        "seq-length": 256,
        "bf16": True,
        "recompute-granularity": "full",
        "lr": 2e-5,
        "lr-warmup-iters": 0,
        "grpo-prompts-per-step": 2,
        "grpo-group-size": 4,
        "micro-batch-size": 4,
        "train-iters": 2,
    }
    teacher = tmp_path / "teacher"
    args = {**shared, "hf-checkpoint": smollm2_checkpoint, "rl-forced-lag": 0}
    run_training(1, {**args, "save-hf": teacher}, timeout=900)
    metrics = run_training(
        1,
        {
            **args,
            "rl-forced-lag": 1,
            "distill-teacher": teacher,
            "distill-coef": "only",
            **variant,
        },
        timeout=900,
    )
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:
        assert m["staleness_min"] == m["staleness_max"] == min(m["step"], 1)
        assert m["distill/reverse_kl"] != 0.0 and m["grad_norm"] > 0.0
        assert 0.0 <= m["distill/argmax_mismatch"] < 1.0
        assert m["distill/teacher_logprob"] < 0.0 and m["distill/student_logprob"] < 0.0
        if variant:
            assert m["distill/topk_kl"] > 0.0
            assert 0.0 < m["distill/teacher_topk_mass"] <= 1.0 + 1e-6
