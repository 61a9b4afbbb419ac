"""On-policy distillation against the README recipe's GRPO run: how many steps and how much
training wall time a student (SmolLM2-135M-Instruct) needs to reach the held-out accuracy the RL
run has after all its steps, when a trained teacher scores every sampled token, and whether the
student picks up the teacher's wrong answers.

    python tools/benchmarks/distill.py --work DIR [--teacher HF_DIR --teacher-eval DUMP]
        [--steps 8 --eval-every 2 --out benchmarks/results]

The teacher is the recipe's command with Dr.GRPO's aggregation (its best run) trained for 26 steps
and exported with ``--save-hf`` (done first, into ``--work``, unless ``--teacher`` gives one).

Two runs, one after the other with the machine to themselves, each the recipe's exact command at
forced lag 0 (``recipe.ours_command``: same model, task, held-out split, prompts per step, group
size, learning rate and warmup, bfloat16, threads; settings not given default to the RL run's in
``--rl-results``) for ``--steps`` steps, evaluated at the start (``--val-at-start``) and every
``--eval-every`` steps, with the teacher ``--teacher`` (a Hugging Face directory, the same
tokenizer: a trained export of the recipe) added:

* "distill only": ``--distill-teacher T --distill-coef only``: the per-token advantage is
  ``log pi_teacher(y_t) - log pi_old(y_t)`` alone (the student before the step), no reward;
* "distill + reward": ``--distill-teacher T --distill-coef 1``: the group-normalised reward's
  advantage plus that term;
* "distill only, top-64": ``--distill-coef only --distill-topk-logits-k 64``: instead, each
  token's loss gains the reverse KL between the student's and the teacher's distributions on
  the teacher's 64 most likely ids.

They are compared with the RL run ``--rl-run`` (default "ours L=0") read from ``--rl-results``
(``recipe.json``, measured on the same machine), not rerun. Evaluation and wall time are
``recipe.read_ours``'s: greedy accuracy on the 200 held-out problems with its 95% Wilson interval,
pass@k from the samples, wall time the sum of ``step_seconds`` (teacher scoring included,
evaluation excluded). Each step's ``distill/*`` metrics (reverse KL, teacher and student
log-probabilities of the sampled tokens, teacher argmax mismatch) are kept.

Checks:

* teacher: its greedy accuracy (95% Wilson interval) from its evaluation dump ``--teacher-eval``;
* target: the RL run's last (step-26) greedy accuracy and interval; for each run the first
  evaluated step whose accuracy is at least that interval's lower bound, its wall time, and
  whether the step is at most a third of the RL run's steps;
* copy: on the held-out problems the teacher gets wrong, how many the student gets right, how
  often its greedy response equals the teacher's exactly and how often it gives the same wrong
  final answer (the reward's extraction, see ``distill_report``), at the run's last evaluation
  and, as the baseline, at its start (``eval-v0.jsonl``, the untrained model).

Writes ``distill.json`` (every number, the machine, settings and commands), ``distill.md`` (the
tables) and ``distill.png`` (accuracy against steps and wall time) into ``--out``. ``--collect``
reads finished run directories in ``--work`` instead of training.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchmarks.common import REPO, machine, portable, subprocess_env  # noqa: E402
from tools.benchmarks.distill_report import (  # noqa: E402
    copy_check,
    first_reaching,
    greedy_accuracy,
    markdown,
    plot,
)
from tools.benchmarks.recipe import ours_command, read_ours, run_ours  # noqa: E402
from tools.benchmarks.recipe_report import significant  # noqa: E402

RUNS: tuple[tuple[str, str, int | None], ...] = (
    ("distill only", "only", None),
    ("distill + reward", "1", None),
    ("distill only, top-64", "only", 64),
)
"""(name, ``--distill-coef``, ``--distill-topk-logits-k``) of the runs."""
RECIPE_SETTINGS = (
    "prompts",
    "group_size",
    "micro_batch_size",
    "lr",
    "warmup",
    "temperature",
    "eval_prompts",
    "eval_samples",
    "threads",
)
"""The recipe's settings a run shares with the RL run (``recipe.json``'s defaults)."""
DISTILL_KEYS = (
    "distill/reverse_kl",
    "distill/teacher_logprob",
    "distill/student_logprob",
    "distill/argmax_mismatch",
    "distill/topk_kl",
    "distill/teacher_topk_mass",
    "distill/student_topk_mass",
)


def run_dir(work: Path, name: str) -> Path:
    """A run's directory under ``work`` ("distill + reward" -> ``distill_reward``)."""
    return work / "_".join(name.replace("+", " ").replace(",", " ").split())


def extra_flags(teacher: Path, coef: str, topk: int | None) -> tuple[str, ...]:
    """The distillation flags added to the recipe's command."""
    topk_flags = () if topk is None else ("--distill-topk-logits-k", str(topk))
    return ("--distill-teacher", str(teacher), "--distill-coef", coef, *topk_flags)


def distill_metrics(out: Path) -> list[dict[str, Any]]:
    """Each step's ``distill/*`` metrics from the run's ``metrics.jsonl`` (None where absent)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{key: r.get(key) for key in DISTILL_KEYS} for r in records]


def reaches(evals: list[dict[str, Any]], low: float, third: float) -> dict[str, Any] | None:
    """The first evaluation at or above ``low``: its step, wall time, accuracy, and whether the
    step is at most ``third``; None when no evaluation gets there."""
    hit = first_reaching(evals, low)
    if hit is None:
        return None
    return {
        "step": hit["step"],
        "seconds": hit["seconds"],
        "greedy_accuracy": hit["greedy_accuracy"],
        "within_third": hit["step"] <= third,
    }


def measure_run(
    name: str,
    coef: str,
    topk: int | None,
    opts: argparse.Namespace,
    ckpt: Path,
    work: Path,
    target_low: float,
    third: float,
) -> dict[str, Any]:
    """Train (or with ``--collect`` read) one distillation run and check it."""
    out = run_dir(work, name)
    extra = extra_flags(opts.teacher, coef, topk)
    run = read_ours(opts, out) if opts.collect else run_ours(0, opts, ckpt, out, extra)
    for step, metrics in zip(run["steps"], distill_metrics(out)):
        step.update(metrics)
    dumps = out / "eval"
    checks = {
        f"{step} (start)" if step == 0 else str(step): copy_check(
            opts.teacher_eval, dumps / f"eval-v{step}.jsonl"
        )
        for step in (0, opts.steps)
    }
    return {
        **run,
        "significant": significant(run["evals"]),
        "reaches": reaches(run["evals"], target_low, third),
        "copy_check": checks,
        "distill_coef": coef,
        "distill_topk_logits_k": topk,
        "extra_flags": list(extra),
        "command": [str(c) for c in ours_command(0, opts, ckpt, out, extra)],
        "run_dir": str(out),
    }


TEACHER_FLAGS = ("--loss-agg-mode", "seq-mean-token-sum-norm", "--scale-rewards", "none")
"""The teacher's recipe variant: Dr.GRPO's aggregation at lag 0 (the recipe's best run)."""
TEACHER_STEPS = 26


def train_teacher(opts: argparse.Namespace, ckpt: Path, work: Path) -> tuple[Path, Path]:
    """Train the teacher with the recipe's command (``TEACHER_FLAGS``, ``TEACHER_STEPS`` steps,
    one evaluation at the end) and export it; its Hugging Face directory and evaluation dump."""
    out, export = work / "teacher_run", work / "teacher_hf"
    settings = argparse.Namespace(**{**vars(opts), "steps": TEACHER_STEPS})
    settings.eval_every = TEACHER_STEPS
    if not (export / "config.json").is_file():
        command = ours_command(0, settings, ckpt, out, (*TEACHER_FLAGS, "--save-hf", str(export)))
        command.remove("--val-at-start")
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "train.log", "w") as log:
            subprocess.run(
                command,
                cwd=REPO,
                env=subprocess_env(opts.threads),
                stdout=log,
                stderr=subprocess.STDOUT,
                check=True,
            )
    return export, out / "eval" / f"eval-v{TEACHER_STEPS}.jsonl"


def rl_baseline(path: Path, name: str) -> dict[str, Any]:
    """The RL run ``name`` from ``recipe.json`` at ``path``: evaluations, steps, settings."""
    recipe = json.loads(path.read_text())
    if name not in recipe["runs"]:
        raise SystemExit(f"{path} has no run {name!r} (runs: {', '.join(recipe['runs'])})")
    return {**recipe["runs"][name], "name": name, "source": str(path)}


def parse_args() -> argparse.Namespace:
    """The command line; recipe settings left unset take the RL run's values."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--teacher",
        type=Path,
        default=None,
        help="The teacher's Hugging Face directory (default: train it first into --work with "
        "the recipe's command, Dr.GRPO aggregation, 26 steps, and export it).",
    )
    parser.add_argument(
        "--teacher-eval",
        type=Path,
        default=None,
        help="The teacher's held-out evaluation dump (a --val-dump-dir JSONL file); needed with "
        "--teacher.",
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=2)
    for setting in RECIPE_SETTINGS:
        kind = float if setting in ("lr", "temperature") else int
        parser.add_argument(
            f"--{setting.replace('_', '-')}",
            type=kind,
            default=None,
            help="Default: the RL run's value in --rl-results.",
        )
    parser.add_argument(
        "--rl-results", type=Path, default=REPO / "benchmarks" / "results" / "recipe.json"
    )
    parser.add_argument("--rl-run", default="ours L=0")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[n for n, _, _ in RUNS],
        default=None,
        help="Runs to make (default: all); the others keep their numbers from the existing "
        "NAME.json in --out.",
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument(
        "--name", default="distill", help="Stem of the files written (NAME.json, .md, .png)."
    )
    parser.add_argument("--work", type=Path, default=None, help="Keep the runs' files here.")
    parser.add_argument(
        "--collect",
        action="store_true",
        help="Measure nothing: read the runs from the finished run directories in --work and "
        "write the results.",
    )
    opts = parser.parse_args()
    if opts.collect and opts.work is None:
        parser.error("--collect needs --work")
    if (opts.teacher is None) != (opts.teacher_eval is None):
        parser.error("--teacher and --teacher-eval go together (neither: train the teacher)")
    if opts.teacher is None and opts.work is None:
        parser.error("training the teacher needs --work (where it is kept)")
    if opts.teacher is not None and not opts.collect:
        if not (opts.teacher / "config.json").is_file():
            parser.error(f"--teacher {opts.teacher} is not a Hugging Face directory")
        if not opts.teacher_eval.is_file():
            parser.error(f"--teacher-eval {opts.teacher_eval} does not exist")
    return opts


def main() -> None:
    opts = parse_args()
    rl = rl_baseline(opts.rl_results, opts.rl_run)
    for setting in RECIPE_SETTINGS:
        if getattr(opts, setting) is None:
            setattr(opts, setting, rl["settings"][setting])
    differ = {
        s: rl["settings"][s] for s in RECIPE_SETTINGS if getattr(opts, s) != rl["settings"][s]
    }
    if differ:
        print(f"distill: settings differ from the RL run's {differ}", flush=True)

    from megatron.rl.models.hf.gguf import SMOLLM2, packaged_checkpoint

    ckpt = packaged_checkpoint(SMOLLM2)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    target = rl["evals"][-1]
    third = rl["steps"][-1]["step"] / 3
    rl["target"] = target
    rl["reaches"] = reaches(rl["evals"], target["greedy_ci95"][0], third)
    previous = opts.out / f"{opts.name}.json"
    res = json.loads(previous.read_text()) if opts.only and previous.exists() else {"runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = opts.work or Path(tmp)
        if opts.teacher is None:
            print("distill: training the teacher", flush=True)
            opts.teacher, opts.teacher_eval = train_teacher(opts, ckpt, work)
        for name, coef, topk in RUNS:
            if opts.only and name not in opts.only:
                continue
            print(f"distill: {name}", flush=True)
            low = target["greedy_ci95"][0]
            run = measure_run(name, coef, topk, opts, ckpt, work, low, third)
            res["runs"][name] = {**run, "started": started}
    settings = {k: v for k, v in vars(opts).items() if k not in ("out", "work", "only", "name")}
    res.update(
        started=started,
        machine=machine(),
        checkpoint=SMOLLM2.filename,
        settings={k: str(v) if isinstance(v, Path) else v for k, v in settings.items()},
        settings_differing_from_rl=differ,
        eval_prompts=opts.eval_prompts,
        eval_samples=opts.eval_samples,
        teacher=greedy_accuracy(opts.teacher_eval),
        rl=rl,
        third_of_rl_steps=third,
    )
    res = portable(res, work=opts.work)
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / f"{opts.name}.json").write_text(json.dumps(res, indent=1))
    plot(res, opts.out / f"{opts.name}.png")
    (opts.out / f"{opts.name}.md").write_text(markdown(res) + "\n")
    print(markdown(res))


if __name__ == "__main__":
    main()
