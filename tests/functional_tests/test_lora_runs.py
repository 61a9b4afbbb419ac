"""LoRA runs of ``pretrain_grpo.py`` end to end (the golden cases ``lora_lag2``,
``lora_lag2_tp2`` and ``lora_lag2_resume`` are compared by ``test_pretrain_grpo.py``).

* At forced lag 0 the engine's logprobs are the trainer's pi_old at every step: the engine
  generates with base + the current adapter (an adapter trained but not used by generation would
  show as a mismatch from step 1 on, once the first update made B non-zero).
* ``--save-lora`` writes a PEFT directory that ``peft.PeftModel`` loads onto the Hugging Face
  base, ``--save-hf`` the merged model: both give the same logits, and ``--lora-checkpoint`` of
  the directory continues from the trained adapters.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from golden_values import load_case, run_training
from launching import ROOT, subprocess_env

from megatron.rl.models.hf.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def lora_args(tmp_path_factory):
    """``lora_lag2``'s flags with its tiny Llama and environment made here."""
    case = load_case("lora_lag2")
    work = tmp_path_factory.mktemp("lora")
    tiny = case["tiny_hf_checkpoint"]
    envs = work / "envs.yaml"
    envs.write_text(case["env_config"])
    hf = make_tiny_checkpoint(tiny["family"], work / "tiny_hf", seed=tiny["seed"])
    return {**case["args"], "hf-checkpoint": hf, "env-config": envs}, work


def test_at_lag_0_the_engine_generates_with_the_current_adapter(lora_args):
    args, _ = lora_args
    metrics = run_training(1, {**args, "rl-forced-lag": 0, "train-iters": 6})
    assert all(m["grad_norm"] > 0 for m in metrics)  # the adapters move every step
    assert max(abs(m["mismatch_kl"]) for m in metrics) < 1e-6, [m["mismatch_kl"] for m in metrics]
    assert max(m["clip_fraction"] for m in metrics) == 0.0  # one update per batch: ratio 1


def bf16_copy(directory: Path, out: Path) -> Path:
    """``directory``'s checkpoint with its weights stored in bfloat16 (``torch_dtype``
    bfloat16), tokenizer files alongside."""
    import shutil

    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(out)
    for name in directory.iterdir():
        if name.name.startswith("tokenizer") or name.name == "special_tokens_map.json":
            shutil.copy2(name, out / name.name)
    return out


@pytest.mark.parametrize(
    "family, checkpoint_dtype",
    [("llama", "float32"), ("qwen2", "float32"), ("qwen3", "bfloat16")],
)
def test_bf16_run_exports_the_base_plus_the_adapter_it_trained(lora_args, family, checkpoint_dtype):
    """Under ``--bf16`` the run keeps its frozen base in bfloat16; ``--save-hf`` merges the
    adapters onto the checkpoint's own base values in float32 and writes float32, so the export
    gives what PEFT gives with the original base and ``--save-lora``'s adapter (a merge rounded to
    bfloat16, or onto the rounded base, differs by more than the tolerance)."""
    pytest.importorskip("peft")
    import transformers
    from peft import PeftModel

    args, work = lora_args
    work = work / f"{family}-{checkpoint_dtype}"
    hf = make_tiny_checkpoint(family, work / "base", seed=3)
    if checkpoint_dtype == "bfloat16":
        hf = bf16_copy(hf, work / "base-bf16")
    lora, merged = work / "adapter", work / "merged"
    run_training(
        1,
        {
            **args,
            "hf-checkpoint": hf,
            "bf16": True,
            "train-iters": 3,
            "lr": 0.002,
            "save-lora": lora,
            "save-hf": merged,
        },
    )
    config = json.loads((lora / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert config["base_model_name_or_path"] == str(hf.resolve())
    assert json.loads((merged / "config.json").read_text())["torch_dtype"] == "float32"
    ids = torch.randint(5, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    base = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, lora).eval()(input_ids=ids).logits
        full = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(
            input_ids=ids
        ).logits
    assert (adapted - plain).abs().max() > 1e-2  # the adapters moved the policy
    torch.testing.assert_close(full, adapted, atol=1e-3, rtol=0)


def test_evaluating_the_export_answers_as_evaluating_the_adapter(lora_args):
    """``evaluate`` on the merged export and ``evaluate --lora-checkpoint`` on the base give
    the same greedy answers (a bf16 run's export: the case the merge used to round away)."""
    args, work = lora_args
    lora, merged = work / "eval-adapter", work / "eval-merged"
    run_training(
        1,
        {**args, "bf16": True, "train-iters": 3, "save-lora": lora, "save-hf": merged},
    )
    common = [
        "--env-config", str(args["env-config"]), "--seq-length", "64",
        "--rl-default-max-tokens", "8", "--seed", "7", "--eval-prompts", "8",
        "--eval-samples", "1",
    ]  # fmt: skip
    answers = []
    for name, model in (
        ("export", ["--hf-checkpoint", str(merged)]),
        (
            "adapter",
            ["--hf-checkpoint", str(args["hf-checkpoint"]), "--lora-checkpoint", str(lora)],
        ),
    ):
        dump = work / f"dump-{name}"
        proc = subprocess.run(
            [sys.executable, "-m", "megatron.trainer.evaluate", *model, *common,
             "--val-dump-dir", str(dump)],
            cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        records = [json.loads(line) for line in (dump / "eval-v0.jsonl").read_text().splitlines()]
        answers.append([(r["prompt"], r["response"]) for r in records if r["pass"] == "greedy"])
    assert answers[0] == answers[1] and len(answers[0]) == 8


def test_lora_checkpoint_continues_from_the_saved_adapter(lora_args):
    """A run started from its own --save-lora directory (rank and alpha from its
    adapter_config.json) trains the saved adapters: its first gradient is not a fresh adapter's
    (B = 0: A gets none), and the engine generates with them (no mismatch at lag 0)."""
    args, work = lora_args
    adapter = work / "adapter"
    if not (adapter / "adapter_config.json").exists():
        run_training(1, {**args, "train-iters": 4, "save-lora": adapter})
    short = {**args, "train-iters": 1, "rl-forced-lag": 0}
    fresh = run_training(1, short)
    flags = {k: v for k, v in short.items() if k not in ("lora-rank", "lora-alpha")}
    continued = run_training(1, {**flags, "lora-checkpoint": adapter})
    assert continued[0]["grad_norm"] != pytest.approx(fresh[0]["grad_norm"], rel=1e-3)
    assert abs(continued[0]["mismatch_kl"]) < 1e-6


@pytest.mark.slow
def test_smollm2_bf16_lora_export_is_base_plus_adapter(smollm2_checkpoint, tmp_path):
    """SmolLM2-135M-Instruct, 2 steps of rank-8 LoRA at lr 1e-3 under ``--bf16``: the merged
    export's logits are PEFT's (original base + ``--save-lora``'s adapter) within 1e-3."""
    pytest.importorskip("peft")
    import transformers
    from peft import PeftModel

    lora, merged = tmp_path / "adapter", tmp_path / "merged"
    run_training(
        1,
        {
            "hf-checkpoint": smollm2_checkpoint,
            "env-config": ROOT / "examples/rl/environment_configs/arithmetic.yaml",
            "seq-length": 160, "rl-default-max-tokens": 24, "bf16": True, "rl-forced-lag": 0,
            "grpo-prompts-per-step": 2, "grpo-group-size": 4, "micro-batch-size": 8,
            "train-iters": 2, "lr": 1e-3, "lr-warmup-iters": 0, "lora-rank": 8,
            "lora-alpha": 32, "grpo-entropy-term-weight": 0.5, "save-lora": lora,
            "save-hf": merged,
        },
    )  # fmt: skip
    ids = torch.randint(100, 40000, (2, 24), generator=torch.Generator().manual_seed(0))
    base = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_checkpoint, dtype=torch.float32
    )
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, lora).eval()(input_ids=ids).logits
        full = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(
            input_ids=ids
        ).logits
    assert (adapted - plain).abs().max() > 1e-2  # the adapters moved the policy
    torch.testing.assert_close(full, adapted, atol=1e-3, rtol=0)
