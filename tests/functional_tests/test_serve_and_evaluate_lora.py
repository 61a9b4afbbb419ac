"""``serve`` and ``evaluate`` with a LoRA adapter: a PEFT directory (``--lora-checkpoint``) or a LoRA
run's checkpoint (``--load`` with its ``--lora-rank`` flags) on the Hugging Face base generates
what the merged export generates, and evaluates as the trainer evaluated it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import test_serve_and_evaluate
from golden_values import ROOT, flag_argv
from serving import (
    assert_greedy,
    assert_one_message,
    command_env,
    hf_logprobs,
    read_records,
    run,
    start_server,
)
from test_serve_and_evaluate import EVAL_FLAGS, MODEL_FLAGS

env_config = test_serve_and_evaluate.env_config  # the fixture, shared

LORA_FLAGS = ["--lora-rank", "4", "--lora-alpha", "8"]


@pytest.fixture(scope="module")
def tiny(tiny_hf_checkpoints) -> Path:
    return tiny_hf_checkpoints["llama3"]


@pytest.fixture(scope="module")
def trained(tiny, env_config, tmp_path_factory) -> dict[str, Path]:
    """Two LoRA updates from the tiny checkpoint: its checkpoint, PEFT directory, merged export
    and the trainer's evaluation after them."""
    out = tmp_path_factory.mktemp("trained_lora")
    paths = {"ck": out / "CK", "hf": out / "merged", "lora": out / "adapter", "dump": out / "dump"}
    argv = [
        *MODEL_FLAGS,
        *EVAL_FLAGS,
        *LORA_FLAGS,
        *flag_argv(
            {
                "hf-checkpoint": str(tiny),
                "env-config": str(env_config),
                "grpo-prompts-per-step": "2",
                "grpo-group-size": "2",
                "micro-batch-size": "4",
                "train-iters": "2",
                "lr": "0.2",
                "lr-warmup-iters": "0",
                "grpo-entropy-term-weight": "0.5",
                "val-at-end": True,
                "val-dump-dir": str(paths["dump"]),
                "save": str(paths["ck"]),
                "save-hf": str(paths["hf"]),
                "save-lora": str(paths["lora"]),
                "plot-file": "none",
            }
        ),
    ]
    proc = subprocess.run(
        [sys.executable, "pretrain_grpo.py", *argv],
        cwd=ROOT,
        env=command_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return paths


@pytest.mark.parametrize("source", ["lora-checkpoint", "load"])
def test_served_adapter_generates_what_the_merged_model_generates(trained, tiny, source):
    flags = {
        "lora-checkpoint": ["--lora-checkpoint", str(trained["lora"])],
        "load": ["--load", str(trained["ck"]), *LORA_FLAGS],
    }[source]
    served = start_server(
        ["--hf-checkpoint", str(tiny), "--seq-length", "64", *flags], command_env()
    )
    try:
        choice = (
            served.client(key="x")
            .completions.create(
                model=served.name, prompt="copy: 1234 -> ", max_tokens=10, temperature=0, logprobs=1
            )
            .choices[0]
        )
        tokens = assert_greedy(trained["hf"], choice, 10)
        prompt, logprobs = choice.model_extra["prompt_token_ids"], choice.logprobs.token_logprobs
        assert logprobs == pytest.approx(hf_logprobs(trained["hf"], prompt, tokens), abs=1e-4)
        base = hf_logprobs(tiny, prompt, tokens)
        assert max(abs(a - b) for a, b in zip(logprobs, base)) > 1e-3  # not the base
        assert served.stop(signal.SIGTERM) == 0
    finally:
        if served.proc.poll() is None:
            served.proc.kill()


def test_evaluation_of_the_lora_checkpoint_equals_the_trainers(trained, tiny, env_config, tmp_path):
    output = tmp_path / "eval.json"
    argv = [
        "--hf-checkpoint",
        str(tiny),
        "--env-config",
        str(env_config),
        *MODEL_FLAGS,
        *EVAL_FLAGS,
        *LORA_FLAGS,
        "--load",
        str(trained["ck"]),
        "--val-dump-dir",
        str(tmp_path / "dump"),
        "--output-json",
        str(output),
    ]
    proc = run("megatron.trainer.evaluate", argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(output.read_text())["policy_version"] == 2
    assert read_records(tmp_path / "dump" / "eval-v2.jsonl") == read_records(
        trained["dump"] / "eval-v2.jsonl"
    )


def test_a_lora_checkpoint_without_its_lora_flags_is_refused_naming_them(trained, tiny, env_config):
    argv = [
        "--hf-checkpoint",
        str(tiny),
        "--env-config",
        str(env_config),
        *MODEL_FLAGS,
        *EVAL_FLAGS,
        "--load",
        str(trained["ck"]),
    ]
    proc = run("megatron.trainer.evaluate", argv)
    assert_one_message(proc, 1, "--lora-rank", "(here: 0)")


def merged_copy(base: Path, adapter: Path, out: Path, scale_b: float = 1.0) -> tuple[Path, Path]:
    """A second adapter (``adapter``'s with every B times ``scale_b``) and the Hugging Face
    directory of ``base`` with it merged (PEFT's ``merge_and_unload``)."""
    import shutil

    import torch
    import transformers
    from peft import PeftModel
    from safetensors.torch import load_file, save_file

    other = out / "adapter"
    other.mkdir(parents=True)
    shutil.copy2(adapter / "adapter_config.json", other)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    scaled = {k: v * scale_b if "lora_B" in k else v for k, v in tensors.items()}
    save_file(scaled, str(other / "adapter_model.safetensors"))
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, other).merge_and_unload()
    merged.save_pretrained(out / "merged")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (base / name).is_file():
            shutil.copy2(base / name, out / "merged" / name)
    return other, out / "merged"


def test_several_adapters_are_served_by_name_in_one_engine(trained, tiny, tmp_path):
    """``--lora NAME=DIR NAME=DIR``: each name generates with its adapter (what its merged model
    generates), the base with none, concurrently in one engine; an unknown name is a 404."""
    import concurrent.futures

    import openai

    pytest.importorskip("peft")
    other, other_merged = merged_copy(tiny, trained["lora"], tmp_path, scale_b=-1.0)
    served = start_server(
        [
            "--hf-checkpoint",
            str(tiny),
            "--seq-length",
            "64",
            "--lora",
            f"tuned={trained['lora']}",
            f"flipped={other}",
            "--served-model-name",
            "base",
        ],
        command_env(),
    )
    try:
        client = served.client(key="x")
        assert [m.id for m in client.models.list().data] == ["base", "tuned", "flipped"]

        def ask(model: str):
            return client.completions.create(
                model=model, prompt="copy: 1234 -> ", max_tokens=8, temperature=0
            ).choices[0]

        with concurrent.futures.ThreadPoolExecutor(6) as pool:  # in the same engine steps
            choices = list(pool.map(ask, ["tuned", "base", "flipped"] * 2))
        for choice, expected in zip(choices, [trained["hf"], tiny, other_merged] * 2):
            assert_greedy(expected, choice, 8)
        assert len({tuple(c.model_extra["token_ids"]) for c in choices[:3]}) > 1
        with pytest.raises(openai.NotFoundError) as err:
            ask("missing")
        assert (
            "the model 'missing' is not served here ('base', 'tuned', 'flipped')"
            in err.value.response.text
        )
        assert served.stop(signal.SIGTERM) == 0
    finally:
        if served.proc.poll() is None:
            served.proc.kill()


def test_serve_refuses_a_bad_adapter_naming_the_flag(tiny, tmp_path):
    proc = run("megatron.trainer.serve", ["--hf-checkpoint", str(tiny), "--lora", f"x={tmp_path}"])
    assert_one_message(proc, 2, f"--lora x={tmp_path}", "not a PEFT adapter directory")
    proc = run("megatron.trainer.serve", ["--hf-checkpoint", str(tiny), "--lora", "no-equals"])
    assert_one_message(proc, 2, "--lora 'no-equals': expected NAME=DIR")
