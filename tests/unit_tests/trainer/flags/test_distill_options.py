"""The on-policy distillation options: off by default, the teacher's directory and tokenizer
checked before anything is built, refusals that name the flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron.rl.grpo.distill import DistillConfig
from megatron.rl.models.hf.tiny import make_tiny_checkpoint
from megatron.trainer.config import distill_config, step_config, teacher_source
from megatron.trainer.flags.parse import check


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny Hugging Face directories: a student, a larger teacher with the student's tokenizer,
    and a model with another tokenizer."""
    root = tmp_path_factory.mktemp("distill_models")
    return {
        "student": make_tiny_checkpoint("qwen2", root / "student", seed=1),
        "teacher": make_tiny_checkpoint("qwen2", root / "teacher", seed=2, hidden_size=96),
        "other": make_tiny_checkpoint("qwen2", root / "other", tokenizer_vocab_size=320),
    }


def test_distillation_is_off_by_default():
    args, errors = check([], 1, False)
    assert errors == [] and distill_config(args, 64) is None and teacher_source(args) is None
    assert not any(k.startswith("distill/") for k in step_config(args, 64).metric_keys())


@pytest.mark.parametrize(
    "coef, expected",
    [
        pytest.param([], DistillConfig(1.0), id="default"),
        pytest.param(["--distill-coef", "0.25"], DistillConfig(0.25), id="mixed"),
        pytest.param(["--distill-coef", "only"], DistillConfig(1.0, reward=False), id="only"),
        pytest.param(["--distill-coef", "0"], None, id="zero-is-plain-rl"),
        pytest.param(
            ["--distill-topk-logits-k", "16", "--distill-coef", "only"],
            DistillConfig(1.0, reward=False, topk=16),
            id="topk-only",
        ),
        pytest.param(
            ["--distill-topk-logits-k", "16", "--policy-loss", "gspo"],
            DistillConfig(1.0, topk=16),
            id="topk-is-a-loss-term-any-surrogate-takes",
        ),
    ],
)
def test_the_coefficient_sets_the_teacher_term(models, coef, expected):
    argv = ["--hf-checkpoint", str(models["student"]), "--distill-teacher", str(models["teacher"])]
    args, errors = check(argv + coef, 1, False)
    assert errors == []
    assert distill_config(args, 301) == expected
    source = teacher_source(args)
    if expected is None:
        assert source is None
    else:  # a Hugging Face teacher keeps its own architecture
        assert source.directory == str(models["teacher"]) and source.hf.arch.hidden_size == 96
        keys = step_config(args, 301).metric_keys()
        assert "distill/reverse_kl" in keys
        assert ("distill/topk_kl" in keys) == (expected.topk is not None)


def test_a_top_k_larger_than_the_vocabulary_is_refused_naming_the_flag(models):
    argv = ["--hf-checkpoint", str(models["student"]), "--distill-teacher", str(models["teacher"])]
    args, errors = check(argv + ["--distill-topk-logits-k", "302"], 1, False)
    assert errors == []
    with pytest.raises(ValueError, match=r"--distill-topk-logits-k 302 exceeds the vocabulary"):
        step_config(args, 301)


def test_a_checkpoint_directory_of_ours_is_a_teacher_of_the_policys_architecture(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    args, errors = check(["--distill-teacher", str(tmp_path)], 1, False)
    assert errors == [] and teacher_source(args).hf is None


@pytest.mark.parametrize(
    "argv, message",
    [
        pytest.param(
            ["--distill-coef", "0.5"],
            "--distill-coef needs --distill-teacher",
            id="coef-without-teacher",
        ),
        pytest.param(
            ["--distill-teacher", "{student}", "--distill-coef", "much"],
            "--distill-coef must be a number >= 0 or 'only', got 'much'",
            id="coef-not-a-number",
        ),
        pytest.param(
            ["--distill-teacher", "{student}", "--distill-coef", "-1"],
            "--distill-coef must be a number >= 0 or 'only', got '-1'",
            id="coef-negative",
        ),
        pytest.param(
            ["--distill-teacher", "/no/such/teacher"],
            "--distill-teacher: no such directory '/no/such/teacher'",
            id="missing-directory",
        ),
        pytest.param(
            ["--distill-teacher", "{empty}"],
            "--distill-teacher {empty}: neither a Hugging Face model directory (no config.json), "
            "nor a checkpoint directory of ours (no latest_checkpointed_iteration.txt), nor a "
            "server URL",
            id="neither-kind",
        ),
        pytest.param(
            ["--hf-checkpoint", "{student}", "--distill-teacher", "{other}"],
            "--distill-teacher {other}: its tokenizer is not the policy's ({student})",
            id="another-tokenizer",
        ),
        pytest.param(
            ["--distill-teacher", "{student}"],
            "--distill-teacher {student}: a Hugging Face teacher needs the policy's tokenizer to "
            "be a Hugging Face one",
            id="char-tokenizer-policy",
        ),
        pytest.param(
            ["--hf-checkpoint", "{student}", "--distill-teacher", "{teacher}"]
            + ["--policy-loss", "gspo"],
            "--distill-teacher with --policy-loss gspo: its ratio is per sequence",
            id="sequence-level-surrogate",
        ),
        pytest.param(
            ["--distill-teacher", "http://teacher:8000/v1/completions"],
            "--distill-teacher http://teacher:8000/v1/completions: give the server's base URL",
            id="url-with-a-path",
        ),
        pytest.param(
            ["--distill-teacher", "http://teacher:port"],
            "--distill-teacher http://teacher:port: not a server URL",
            id="url-with-a-bad-port",
        ),
        pytest.param(
            ["--distill-teacher", "http://teacher:8000", "--distill-topk-logits-k", "8"],
            "--distill-topk-logits-k with a server as --distill-teacher (http://teacher:8000)",
            id="url-with-top-k",
        ),
        pytest.param(
            ["--distill-teacher", "http://teacher:8000", "--policy-loss", "gmpo"],
            "--distill-teacher with --policy-loss gmpo: its ratio is per sequence",
            id="url-with-a-sequence-level-surrogate",
        ),
        pytest.param(
            ["--distill-topk-logits-k", "8"],
            "--distill-topk-logits-k needs --distill-teacher",
            id="topk-without-teacher",
        ),
        pytest.param(
            ["--distill-teacher", "{student}", "--distill-topk-logits-k", "0"],
            "--distill-topk-logits-k must be >= 1, got 0",
            id="topk-zero",
        ),
        pytest.param(
            ["--hf-checkpoint", "{student}", "--distill-teacher", "{teacher}"]
            + ["--distill-coef", "only", "--grpo-filter-groups-with-same-reward"],
            "--distill-coef only with --grpo-filter-groups-with-same-reward",
            id="only-with-dynamic-sampling",
        ),
    ],
)
def test_refusals_name_the_flags(models, tmp_path, argv, message):
    names = {**{k: str(v) for k, v in models.items()}, "empty": str(tmp_path)}
    _, errors = check([a.format(**names) for a in argv], 1, False)
    expected = message.format(**names)
    assert any(e.startswith(expected) for e in errors), errors


def test_a_server_url_is_a_remote_teacher_without_argmax(tmp_path, monkeypatch):
    key = tmp_path / "key"
    key.write_text("s3cret-key-of-the-job\n")
    monkeypatch.delenv("MEGATRON_RL_API_KEY", raising=False)
    argv = ["--distill-teacher", "http://teacher:8000", "--rl-api-key-file", str(key)]
    args, errors = check(argv, 1, False)
    assert errors == []
    assert distill_config(args, 64) == DistillConfig(1.0, argmax=False)
    source = teacher_source(args)
    assert source.directory == "http://teacher:8000" and source.hf is None
    assert source.api_key == "s3cret-key-of-the-job"
    keys = step_config(args, 64).metric_keys()
    assert "distill/reverse_kl" in keys and "distill/argmax_mismatch" not in keys
