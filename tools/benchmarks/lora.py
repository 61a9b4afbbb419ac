"""LoRA RL on 2 CPU cores: memory and speed against full fine-tuning and TRL + PEFT, and a model
full fine-tuning cannot hold here.

    python tools/benchmarks/lora.py [--steps 5 --skip 2 --rounds 1] [--large-steps 2]

Part 1, the README recipe's shape at equal work (``real_model.py``'s setting): SmolLM2-135M-
Instruct on the arithmetic word problems, 8 prompts x 8 samples of exactly 64 new tokens (ours
``--rl-ignore-eos``, TRL ``min_new_tokens``), micro-batches of 8, bfloat16, ``--threads`` threads,
one process per configuration, interleaved over ``rounds``:

* ``full``: ``pretrain_grpo.py --bf16 --recompute-granularity full`` (the recipe's command);
* ``LoRA r=R``: the same with ``--lora-rank R --lora-alpha 32`` on all seven projections;
* ``LoRA r=R, no recompute``: without activation recompute (the adapters' run has the memory);
* ``TRL + PEFT r=R``: ``trl_worker.py`` with ``GRPOTrainer(peft_config=LoraConfig(r=R,
  lora_alpha=32, target_modules=<the seven>))``, bfloat16 (no recompute, as TRL defaults).

Per configuration: wall seconds per step from the end of step ``skip - 1`` to the last (start-up
excluded), our training update's seconds per step, the process's peak resident memory (``VmHWM``
and ``ru_maxrss``) and ours per phase (generation window, training update), ``mismatch_kl``.

Part 2 (``--large-steps N`` > 0): a randomly initialised model of SmolLM2-1.7B's shape (24
layers, width 2048, 32 heads, MLP 8192, SmolLM2's 49152-token tokenizer; 1.71B parameters),
written as a bfloat16 Hugging Face directory, trained with LoRA (rank ``--large-rank``) for N steps
at a small batch (2 prompts x 4 samples of 32 tokens); its peak RSS and seconds per step, beside
what full fine-tuning would hold: float32 weights, gradients and two AdamW moments, 16 bytes per
parameter (27 GiB, more than the machine's 24).

Part 3 (``--engine-repeats`` > 0): the engine's decode throughput with the adapter applied
unmerged (an extra low-rank product per adapted layer), with the adapters off, and with the
adapter merged into the bfloat16 weights, and the logprob error of each against the training
forward (``lora_engine.run_engine``).

Writes ``lora.json`` and ``lora.md`` (``lora_report.markdown``) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchmarks.common import REPO, machine, run_trainer  # noqa: E402
from tools.benchmarks.lora_engine import run_engine  # noqa: E402
from tools.benchmarks.lora_report import markdown  # noqa: E402
from tools.benchmarks.real_model import (  # noqa: E402
    ENV_CONFIG,
    measure_ours,
    measure_trl,
    ours_flags,
    run_trl,
)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SMOLLM2_1_7B = dict(
    hidden_size=2048,
    num_hidden_layers=24,
    num_attention_heads=32,
    num_key_value_heads=32,
    intermediate_size=8192,
    max_position_embeddings=8192,
    rope_theta=130000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
"""SmolLM2-1.7B's config.json (architecture fields)."""


def configs(rank: int) -> list[tuple[str, str, list[str]]]:
    """(name, kind ``ours``/``trl``, extra flags) of part 1."""
    lora = ["--lora-rank", str(rank), "--lora-alpha", "32"]
    return [
        ("full", "ours", ["--recompute-granularity", "full"]),
        (f"LoRA r={rank}", "ours", ["--recompute-granularity", "full", *lora]),
        (f"LoRA r={rank}, no recompute", "ours", lora),
        (f"TRL + PEFT r={rank}", "trl", ["--lora-rank", str(rank), "--lora-alpha", "32"]),
    ]


def run_recipe_shape(opts: argparse.Namespace, logs: Path) -> list[dict[str, Any]]:
    """Part 1: every configuration ``rounds`` times, interleaved."""
    from megatron.rl.models.hf.gguf import SMOLLM2, packaged_checkpoint

    ckpt = packaged_checkpoint(SMOLLM2)
    table = configs(opts.rank)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in table}
    for r in range(opts.rounds):
        for name, kind, extra in table if r % 2 == 0 else table[::-1]:
            print(f"  lora: round {r + 1}/{opts.rounds}, {name}", flush=True)
            log = logs / f"{name.replace(' ', '_').replace(',', '').replace('=', '')}_{r}.log"
            if kind == "trl":
                summary = run_trl(True, opts, ckpt, log, logs, extra)
                runs[name].append(measure_trl(summary, opts.skip))
            else:
                flags = ours_flags(0, True, False, opts, ckpt) + extra
                summary = run_trainer(flags, opts.threads, log, timeout_s=3600)
                runs[name].append(measure_ours(summary, opts.skip))
    rows = []
    for name, kind, extra in table:
        row = {k: statistics.fmean(run[k] for run in runs[name]) for k in runs[name][0]}
        row.update(
            name=name,
            kind=kind,
            flags=extra,
            peak_rss_mib=max(run["peak_rss_mib"] for run in runs[name]),
            seconds_per_step_per_round=[run["seconds_per_step"] for run in runs[name]],
        )
        rows.append(row)
    return rows


def write_large_checkpoint(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random bfloat16 Llama of SmolLM2-1.7B's shape with SmolLM2's tokenizer in ``out``
    (weights normal(0, 0.02), norms 1; written tensor by tensor, no model object)."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    source = json.loads((tokenizer_dir / "config.json").read_text())
    config = {**source, **SMOLLM2_1_7B, "torch_dtype": "bfloat16"}
    config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
        "special_tokens_map.json",
    ):
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, out / name)
    g = torch.Generator().manual_seed(seed)
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]

    def normal(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    shard: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(v, h)}
    shard["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    files, index = [], {}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shard[p + f"self_attn.{n}.weight"] = normal(h, h)
        shard[p + "mlp.gate_proj.weight"] = normal(f, h)
        shard[p + "mlp.up_proj.weight"] = normal(f, h)
        shard[p + "mlp.down_proj.weight"] = normal(h, f)
        shard[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        shard[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        if i % 4 == 3 or i == config["num_hidden_layers"] - 1:  # ~1.4 GB files
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            index.update({k: name for k in shard})
            files.append(name)
            shard = {}
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index}, indent=1)
    )
    return out


def run_large(opts: argparse.Namespace, logs: Path, work: Path) -> dict[str, Any]:
    """Part 2: LoRA on the 1.7B shape; its memory and time, and full fine-tuning's estimate."""
    from megatron.rl.models.hf.gguf import SMOLLM2, packaged_checkpoint

    ckpt = write_large_checkpoint(work / "smollm2-1.7b-shape", packaged_checkpoint(SMOLLM2))
    flags = [
        "--hf-checkpoint",
        str(ckpt),
        "--env-config",
        str(ENV_CONFIG),
        "--seq-length",
        "192",
        "--rl-forced-lag",
        "0",
        "--train-iters",
        str(opts.large_steps),
        "--grpo-prompts-per-step",
        "2",
        "--grpo-group-size",
        "4",
        "--micro-batch-size",
        "4",
        "--inference-max-requests",
        "8",
        "--rl-ignore-eos",
        "--rl-default-max-tokens",
        "32",
        "--lr",
        "2e-4",
        "--min-lr",
        "0",
        "--lr-warmup-iters",
        "0",
        "--lr-decay-style",
        "constant",
        "--log-interval",
        "1",
        "--bf16",
        "--recompute-granularity",
        "full",
        "--lora-rank",
        str(opts.large_rank),
        "--lora-alpha",
        "32",
    ]
    print(
        f"  lora: SmolLM2-1.7B shape, LoRA r={opts.large_rank}, {opts.large_steps} steps",
        flush=True,
    )
    summary = run_trainer(flags, opts.threads, logs / "large.log", timeout_s=5400)
    records = summary["steps"]
    parameters = _parameters(logs / "large.log")
    phases = [r.get("phase_memory", {}) for r in records]
    return {
        "parameters": parameters,
        "steps": len(records),
        "seconds_per_step": [r["step_seconds"] for r in records],
        "train_seconds_per_step": [r["train_seconds"] for r in records],
        "peak_rss_mib": summary["peak_rss_mib"],
        "generation_peak_mib": max(
            p["generation"]["peak_mib"] for p in phases if "generation" in p
        ),
        "training_peak_mib": max(p["training"]["peak_mib"] for p in phases if "training" in p),
        "full_finetuning_state_gib": parameters * 16 / 2**30,
        "machine_memory_gib": _machine_memory_gib(),
    }


def _parameters(log: Path) -> int:
    """The model's parameter count from the run's header line (``model  1712.38M parameters``)."""
    for line in log.read_text(encoding="utf-8").splitlines():
        if line.startswith("model ") and "M parameters" in line:
            return int(float(line.split()[1].rstrip("M")) * 1e6)
    raise ValueError(f"{log}: no model line")


def _machine_memory_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="GRPO steps per run (part 1).")
    parser.add_argument("--skip", type=int, default=2, help="Leading steps not measured.")
    parser.add_argument("--rounds", type=int, default=1, help="Interleaved repetitions.")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank of part 1.")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4, help="Constant learning rate.")
    parser.add_argument("--threads", type=int, default=2, help="Torch threads per process.")
    parser.add_argument("--large-steps", type=int, default=2, help="Part 2 steps (0: skip).")
    parser.add_argument("--large-rank", type=int, default=8)
    parser.add_argument("--skip-recipe-shape", action="store_true", help="Skip part 1.")
    parser.add_argument("--engine-repeats", type=int, default=3, help="Part 3 repeats (0: skip).")
    parser.add_argument("--engine-batch", type=int, default=64)
    parser.add_argument("--engine-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--work", type=Path, default=None, help="Keep logs and files here.")
    opts = parser.parse_args()
    res: dict[str, Any] = {
        "machine": machine(),
        "rank": opts.rank,
        "large_rank": opts.large_rank,
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    previous = opts.out / "lora.json"
    if previous.exists():  # a part not measured now keeps its numbers
        res = {**json.loads(previous.read_text()), **res}
    with tempfile.TemporaryDirectory() as tmp:
        work = opts.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if not opts.skip_recipe_shape:
            res["recipe_shape"] = run_recipe_shape(opts, work)
            res["settings"] = {k: v for k, v in vars(opts).items() if k not in ("out", "work")}
        if opts.large_steps > 0:
            res["large"] = run_large(opts, work, work)
    if opts.engine_repeats > 0:  # in this process: last (it starts torch.distributed)
        res["engine"] = run_engine(opts)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "lora.json").write_text(json.dumps(res, indent=1) + "\n")
    (opts.out / "lora.md").write_text(markdown(res) + "\n")
    print(markdown(res))


if __name__ == "__main__":
    main()
