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

import pytest
import torch
from golden_values import load_case, run_training

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


def test_saved_adapter_and_merged_model_give_the_same_logits(lora_args):
    pytest.importorskip("peft")
    import transformers
    from peft import PeftModel

    args, work = lora_args
    lora, merged = work / "adapter", work / "merged"
    run_training(1, {**args, "train-iters": 4, "save-lora": lora, "save-hf": merged})
    config = json.loads((lora / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert config["base_model_name_or_path"] == str(args["hf-checkpoint"].resolve())
    ids = torch.randint(5, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    base = transformers.AutoModelForCausalLM.from_pretrained(
        args["hf-checkpoint"], dtype=torch.float32
    )
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, lora).eval()(input_ids=ids).logits
        full = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(
            input_ids=ids
        ).logits
    torch.testing.assert_close(full, adapted, atol=1e-4, rtol=1e-4)
    assert (adapted - plain).abs().max() > 1e-3  # 4 updates at lr 0.02 moved the policy


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
