"""The README recipe, measured: SmolLM2-135M-Instruct post-trained on arithmetic word problems on
2 CPU cores by our trainer (forced lag 0 and 2) and by TRL's ``GRPOTrainer``, held-out accuracy
against wall-clock time.

    python tools/benchmarks/recipe.py [--steps 26 --eval-every 13 --out benchmarks/results]

The three runs share the model (``megatron.rl.models.hf.gguf.SMOLLM2``), the task
(``examples/rl/environment_configs/arithmetic.yaml``: the same training problems in the same order,
``trl_worker.py --task arithmetic``), prompts per step, group size, token budget (EOS ends a
completion on both sides), temperature, learning rate and warmup (constant after it), clipping,
micro-batch size, bfloat16 mixed precision and ``--threads`` threads; ours also recomputes each
layer in the backward pass (``--recompute-granularity full``: less memory, and faster here). They
run one after the other, each with the machine to itself.

Evaluation is the same for all: ``megatron.trainer.evaluate``'s evaluator (this repository's
engine, bfloat16) on the ``--val-split-fraction 0.1`` held-out problems (200 by default, never
trained on), greedy decoding and ``--eval-samples`` samples per problem at the training
temperature for the unbiased pass@k. Ours evaluates inside the run (``--eval-interval``,
``--val-at-start``); TRL saves a Hugging Face checkpoint every ``--eval-every`` steps, which are
evaluated after its run. Wall-clock time is training time: the sum of the steps' times (ours:
``step_seconds``, which excludes evaluation; TRL: from ``on_train_begin`` to each step's end,
minus the time of its checkpoint saves), so model loading and evaluation count on neither side.

Accuracy is the share of held-out problems whose greedy answer is right, with its 95% Wilson
interval. The table says whether the last accuracy lies above the first evaluation's interval
(outside the start's noise) and, the stricter reading, whether the two intervals are disjoint.
Writes ``recipe.json`` (every number), ``recipe.png`` (greedy accuracy and batch reward against
wall-clock seconds, one line per run) and ``recipe.md`` (the table) into ``--out``; both drawn by
``recipe_report.py`` from the json alone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchmarks.common import REPO, machine, subprocess_env  # noqa: E402
from tools.benchmarks.recipe_report import (  # noqa: E402
    markdown,
    plot,
    seeds_markdown,
    significant,
)

ENV_CONFIG = REPO / "examples" / "rl" / "environment_configs" / "arithmetic.yaml"
RUNS: tuple[tuple[str, int | None, tuple[str, ...]], ...] = (
    ("ours L=0", 0, ()),
    ("ours L=2", 2, ()),
    ("TRL", None, ()),
    # The policy-loss variants, on the L=0 command (same everything else).
    ("ours GSPO L=0", 0, ("--policy-loss", "gspo", "--loss-agg-mode", "seq-mean-token-mean")),
    (
        "ours Dr.GRPO L=0",
        0,
        ("--loss-agg-mode", "seq-mean-token-sum-norm", "--scale-rewards", "none"),
    ),
)
LORA_RUNS: tuple[tuple[int, str], ...] = ((1, "5e-4"), (8, "5e-4"), (32, "5e-4"))
"""(rank, learning rate) of the LoRA runs: alpha 32 and lr 5e-4 (25x full fine-tuning's 2e-5) at
every rank, where AdamW's first updates lower a fixed supervised loss alike at every rank and as
full fine-tuning's do (``lora_rank_probe.py``, benchmarks/results/lora_rank_probe.md)."""
RUNS += tuple(
    (
        f"ours LoRA r={r} L=0" + ("" if lr == "5e-4" else f", lr {lr}"),
        0,
        ("--lora-rank", str(r), "--lora-alpha", "32", "--lr", lr),
    )
    for r, lr in LORA_RUNS
)
DEFAULT_RUNS = ("ours L=0", "ours L=2", "TRL")
DEFAULT_SEED = 1234
"""The trainer's ``--seed`` default: runs at it keep their plain names."""


def shared_flags(opts: argparse.Namespace) -> list[str]:
    """The evaluation flags every evaluation uses (the trainer's and ``evaluate``'s)."""
    return [
        "--env-config",
        str(ENV_CONFIG),
        "--seq-length",
        "256",
        "--val-split-fraction",
        "0.1",
        "--eval-prompts",
        str(opts.eval_prompts),
        "--eval-samples",
        str(opts.eval_samples),
        "--eval-pass-k",
        "1",
        str(opts.eval_samples),
        "--rl-default-temperature",
        str(opts.temperature),
        "--bf16",
    ]


def ours_command(
    lag: int, opts: argparse.Namespace, ckpt: Path, out: Path, extra: tuple[str, ...] = ()
) -> list[str]:
    """``pretrain_grpo.py`` with the recipe's flags (the README's command) at forced lag ``lag``,
    then ``extra`` (a loss variant's flags)."""
    return [
        sys.executable,
        str(REPO / "pretrain_grpo.py"),
        "--hf-checkpoint",
        str(ckpt),
        *shared_flags(opts),
        "--rl-forced-lag",
        str(lag),
        "--grpo-prompts-per-step",
        str(opts.prompts),
        "--grpo-group-size",
        str(opts.group_size),
        "--micro-batch-size",
        str(opts.micro_batch_size),
        "--recompute-granularity",
        "full",
        "--inference-max-requests",
        str(opts.prompts * opts.group_size * (lag + 1)),
        "--lr",
        str(opts.lr),
        "--min-lr",
        "0",
        "--lr-warmup-iters",
        str(opts.warmup),
        "--lr-decay-style",
        "constant",
        "--train-iters",
        str(opts.steps),
        "--eval-interval",
        str(opts.eval_every),
        "--val-at-start",
        "--metrics-file",
        str(out / "metrics.jsonl"),
        "--val-dump-dir",
        str(out / "eval"),
        "--plot-file",
        "none",
        "--seed",
        str(opts.seed),
        *(["--save-hf", str(out / "export")] if "--lora-rank" in extra else []),
        *extra,
    ]


def run_ours(
    lag: int, opts: argparse.Namespace, ckpt: Path, out: Path, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Train at forced lag ``lag``; the per-step records and the evaluations at their times. A
    LoRA run's ``--save-hf`` export (the adapters merged) is evaluated after it too."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.log", "w") as log:
        subprocess.run(
            ours_command(lag, opts, ckpt, out, extra),
            cwd=REPO,
            env=subprocess_env(opts.threads),
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
        )
    return with_export_evaluation(read_ours(opts, out), opts, out)


def with_export_evaluation(run: dict[str, Any], opts, out: Path) -> dict[str, Any]:
    """``run`` with its ``--save-hf`` export's evaluation (``export_eval``: through
    ``evaluate``, at the last evaluation's step and time) if the run wrote one."""
    if (out / "export").is_dir():
        last = run["evals"][-1]
        export = out / "export-eval"
        export.mkdir(exist_ok=True)
        run["export_eval"] = evaluate(out / "export", last["step"], last["seconds"], opts, export)
    return run


def read_ours(opts: argparse.Namespace, out: Path) -> dict[str, Any]:
    """A finished run of ours from its directory: steps and evaluations at their times."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    clock = 0.0
    steps, evals = [], []
    for r in records:
        if "eval_at_start/greedy_reward" in r:
            evals.append(evaluation(r, "eval_at_start/", 0, 0.0, opts))
        clock += r["step_seconds"]
        steps.append({"step": r["step"] + 1, "seconds": clock, "reward": r["reward_mean"]})
        if "eval/greedy_reward" in r:
            evals.append(evaluation(r, "eval/", r["step"] + 1, clock, opts))
    return {"steps": steps, "evals": evals}


def evaluation(metrics: dict, prefix: str, step: int, seconds: float, opts) -> dict[str, Any]:
    """One evaluation's numbers: greedy accuracy (and interval), pass@k, lengths."""
    from megatron.rl.eval.confidence import wilson_interval

    n = int(metrics[f"{prefix}prompts"])
    correct = round(metrics[f"{prefix}greedy_reward"] * n)
    low, high = wilson_interval(correct, n)
    return {
        "step": step,
        "seconds": seconds,
        "prompts": n,
        "greedy_accuracy": correct / n,
        "greedy_ci95": [low, high],
        "sample_reward": metrics[f"{prefix}sample_reward"],
        "pass@1": metrics[f"{prefix}pass@1"],
        f"pass@{opts.eval_samples}": metrics[f"{prefix}pass@{opts.eval_samples}"],
        "greedy_response_length_mean": metrics[f"{prefix}greedy_response_length_mean"],
        "greedy_truncated_fraction": metrics[f"{prefix}greedy_truncated_fraction"],
    }


def run_trl(opts: argparse.Namespace, ckpt: Path, out: Path) -> dict[str, Any]:
    """Train with TRL, saving every ``--eval-every`` steps; evaluate the start and each save."""
    out.mkdir(parents=True, exist_ok=True)
    summary = out / "trl_summary.json"
    cmd = [
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
        "--steps",
        str(opts.steps),
        "--prompts",
        str(opts.prompts),
        "--group-size",
        str(opts.group_size),
        "--micro-batch-size",
        str(opts.micro_batch_size),
        "--lr",
        str(opts.lr),
        "--lr-warmup-steps",
        str(opts.warmup),
        "--temperature",
        str(opts.temperature),
        "--bf16",
        "--save-steps",
        str(opts.eval_every),
        "--output-dir",
        str(out / "checkpoints"),
    ]
    with open(out / "train.log", "w") as log:
        subprocess.run(
            cmd,
            cwd=out,
            env=subprocess_env(opts.threads),
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
        )
    data = json.loads(summary.read_text())
    saved = {s["step"]: s["t"] for s in data["saves"]}
    begin, clock, save_time = data["train_begin"], [], 0.0
    for i, stamp in enumerate(data["steps"]):  # step i + 1 ended at stamp["t"], before its save
        clock.append(stamp["t"] - begin - save_time)
        if i + 1 in saved:
            save_time += saved[i + 1] - stamp["t"]
    steps = [
        {"step": i + 1, "seconds": clock[i], "reward": reward}
        for i, reward in enumerate(data["reward_mean"][: len(clock)])
    ]
    evals = [evaluate(ckpt, 0, 0.0, opts, out)]
    for step in sorted(saved):
        directory = out / "checkpoints" / f"checkpoint-{step}"
        evals.append(evaluate(directory, step, clock[step - 1], opts, out))
    return {"steps": steps, "evals": evals}


def evaluate(directory: Path, step: int, seconds: float, opts, out: Path) -> dict[str, Any]:
    """``python -m megatron.trainer.evaluate`` of a Hugging Face checkpoint."""
    result = out / f"eval-{step}.json"
    cmd = [
        sys.executable,
        "-m",
        "megatron.trainer.evaluate",
        "--hf-checkpoint",
        str(directory),
        *shared_flags(opts),
        "--output-json",
        str(result),
        "--val-dump-dir",
        str(out / "eval" / f"step-{step}"),
    ]
    with open(out / f"eval-{step}.log", "w") as log:
        subprocess.run(
            cmd,
            cwd=REPO,
            env=subprocess_env(opts.threads),
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
        )
    metrics = json.loads(result.read_text())["metrics"]
    return evaluation(metrics, "eval/", step, seconds, opts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=26)
    parser.add_argument("--eval-every", type=int, default=13)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--eval-samples", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[1234],
        help="Run each of ours once per seed (--seed; 1234 is the trainer's default); a run "
        "at another seed is named '<run> seed <S>'.",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[n for n, _, _ in RUNS],
        default=None,
        help=f"Runs to make (default: {', '.join(DEFAULT_RUNS)}); the others keep "
        "their numbers from the existing recipe.json.",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument(
        "--name", default="recipe", help="Stem of the files written (NAME.json, .md, .png)."
    )
    parser.add_argument("--work", type=Path, default=None, help="Keep the runs' files here.")
    parser.add_argument(
        "--collect",
        action="store_true",
        help="Measure nothing: read the --only runs of ours from the finished run directories in "
        "--work (an interrupted invocation's) and write the results.",
    )
    opts = parser.parse_args()

    from megatron.rl.models.hf.gguf import SMOLLM2, packaged_checkpoint

    ckpt = packaged_checkpoint(SMOLLM2)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    previous = opts.out / f"{opts.name}.json"
    res = json.loads(previous.read_text()) if opts.only and previous.exists() else {"runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = opts.work or Path(tmp)
        for seed, (name, lag, extra) in itertools.product(opts.seeds, RUNS):
            if name not in (opts.only or DEFAULT_RUNS) or (lag is None and seed != opts.seeds[0]):
                continue
            opts.seed = seed
            name = name if seed == DEFAULT_SEED else f"{name} seed {seed}"
            print(f"recipe: {name}", flush=True)
            out = work / name.replace(" ", "_").replace("=", "")
            if opts.collect:
                run = with_export_evaluation(read_ours(opts, out), opts, out)
            elif lag is None:
                run = run_trl(opts, ckpt, out)
            else:
                run = run_ours(lag, opts, ckpt, out, extra)
            res["runs"][name] = {
                **run,
                "significant": significant(run["evals"]),
                "started": started,
                "settings": {
                    k: v
                    for k, v in vars(opts).items()
                    if k not in ("out", "work", "only", "name", "seeds")
                },
                "extra_flags": list(extra),
            }
    res.update(
        started=started,
        machine=machine(),
        checkpoint=SMOLLM2.filename,
        eval_prompts=opts.eval_prompts,
        eval_samples=opts.eval_samples,
    )
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / f"{opts.name}.json").write_text(json.dumps(res, indent=1))
    plot(res, opts.out / f"{opts.name}.png")
    table = "\n\n".join(filter(None, [markdown(res), seeds_markdown(res)]))
    (opts.out / f"{opts.name}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
