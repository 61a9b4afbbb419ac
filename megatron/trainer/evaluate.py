"""Evaluate a checkpoint on every environment of an env config, without training.

    python -m megatron.trainer.evaluate --hf-checkpoint DIR --env-config envs.yaml \
        [--eval-prompts N --eval-samples n --eval-pass-k k.. --val-split-fraction F \
         --val-dump-dir DIR --seed S] [--output-json FILE]

The trainer's evaluation, run once on a loaded checkpoint (``checkpoint_model``): the same flags
(``flags/evaluation.py``: prompts, samples, pass@k, correct threshold, validation split, dump
directory), the same environments (``grpo.load_agent``: every entry of the config, evaluation-only
ones included, with the same ``--val-split-fraction`` hold-out as a training run with that
fraction, so the accuracy before and after training is measured on the same problems), and the
same ``Evaluator`` (``evaluation.py``: its own engine with the deterministic schedule, the held-out
set drawn from ``--seed``'s evaluation stream, greedy and sampled passes, unbiased pass@k, response
lengths and truncated share, ``--val-dump-dir``'s ``eval-v<policy version>.jsonl``). The policy
version is the checkpoint's iteration (0 for a Hugging Face checkpoint).

It prints one table row per environment (``format_table``) and writes the same numbers as JSON
with ``--output-json`` (``summary``): besides the trainer's ``eval/*`` metrics, the greedy
accuracy (the share of greedy responses whose reward reaches ``--eval-correct-threshold``) with
its 95% Wilson score interval (``megatron.rl.eval.confidence``). One process (world size 1).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from megatron.trainer.flags.option import EVALUATE
from megatron.trainer.flags.run import RunConfig
from megatron.trainer.runtime.exits import run_main
from megatron.trainer.runtime.kernels import kernel_warnings

with kernel_warnings() as MISSING_KERNELS:  # megatron-core's "not installed" warnings: one line
    from megatron.rl.eval.confidence import wilson_interval
    from megatron.rl.eval.runner import EnvEvaluation, EvalConfig, eval_metrics
    from megatron.trainer import config
    from megatron.trainer.checkpoint_model import (
        CheckpointModel,
        command_parser,
        describe,
        load_checkpoint_model,
        parse_command_args,
    )
    from megatron.trainer.flags.output import output_path_problem
    from megatron.trainer.generation.evaluator import Evaluator
    from megatron.trainer.grpo import load_agent
    from megatron.trainer.runtime.initialize import initialize_distributed, shutdown_distributed

PROG = "megatron.trainer.evaluate"


def build_evaluate_parser() -> argparse.ArgumentParser:
    """The trainer's flags plus ``--output-json``; ``--help`` lists those evaluate reads (model,
    checkpoint, ``--env-config``, the evaluation group, sampling, ``--seed``), ``--help-all``
    every one."""
    parser = command_parser(
        PROG,
        "Evaluate a Hugging Face (--hf-checkpoint) or trainer (--load) checkpoint on every "
        "environment of --env-config without training: greedy reward and accuracy (95% Wilson "
        "interval), sampled reward, unbiased pass@k, response lengths, truncated share. The "
        "flags are pretrain_grpo.py's (evaluation group: --eval-prompts, --eval-samples, "
        "--eval-pass-k, --eval-correct-threshold, --val-split-fraction, --val-dump-dir; sampling: "
        "--rl-default-*; --seed). One process (world size 1).",
        EVALUATE,
    )
    # The command is one evaluation after the last (here: no) training step, so the trainer's
    # checks of the evaluation flags (--val-split-fraction, --val-dump-dir need evaluation) hold.
    parser.set_defaults(val_at_end=True)
    g = parser.add_argument_group("evaluate")
    g.add_argument(
        "--output-json",
        type=str,
        default=None,
        help="Write the numbers of the table (per environment, and the trainer's eval/* "
        "metrics) to this JSON file.",
    )
    return parser


def evaluate_problems(cfg: RunConfig, own: argparse.Namespace) -> list[str]:
    """Why ``--output-json`` cannot be written (probed, nothing left behind)."""
    if own.output_json is None:
        return []
    problem = output_path_problem("--output-json", own.output_json, "file")
    return [problem] if problem else []


def parse_evaluate_args(
    argv: list[str] | None = None,
) -> tuple[RunConfig, argparse.Namespace]:
    """The run config and ``--output-json``, validated; ``UsageError`` (status 2) naming every bad one."""
    return parse_command_args(build_evaluate_parser(), argv, evaluate_problems)


def evaluate(cfg: RunConfig, own: argparse.Namespace) -> dict[str, Any]:
    """Evaluate the checkpoint, print the table, write ``--output-json``; the summary."""
    agent = load_agent(cfg)  # a bad env config exits before anything is built
    ctx = initialize_distributed(cfg)
    evaluator = None
    try:
        loaded = load_checkpoint_model(cfg, ctx)
        print(describe(loaded, cfg, ctx, MISSING_KERNELS), flush=True)
        engine = config.scheduler_config(cfg, ctx.dp_size, loaded.tokenizer, training=False)
        eval_config = config.eval_config(cfg, loaded.tokenizer)
        dump_dir = (
            None if cfg.evaluation.val_dump_dir is None else Path(cfg.evaluation.val_dump_dir)
        )
        evaluator = Evaluator(
            ctx, loaded.tier, loaded.model, loaded.tokenizer, agent, eval_config, engine, dump_dir
        )
        start = time.perf_counter()
        results = evaluator.evaluate(loaded.policy_version)
        seconds = time.perf_counter() - start
        dump = evaluator.dump_path(loaded.policy_version)
        numbers = summary(results, eval_config, cfg, loaded, seconds, dump)
    finally:
        if evaluator is not None:
            evaluator.close()
        shutdown_distributed()
    print(report(numbers), flush=True)
    if own.output_json is not None:
        write_json(Path(own.output_json), numbers)
    return numbers


def summary(
    results: list[EnvEvaluation],
    eval_config: EvalConfig,
    cfg: RunConfig,
    loaded: CheckpointModel,
    seconds: float,
    dump: Path | None = None,
) -> dict[str, Any]:
    """The JSON-able numbers of an evaluation: what was evaluated and how, where its rollouts
    went (``dump``), one entry per environment (``environment_numbers``) and the trainer's
    ``eval/*`` metrics."""
    sampling = eval_config.sampling
    return {
        "checkpoint": loaded.source,
        "policy_version": loaded.policy_version,
        "env_config": cfg.rollouts.env_config,
        "seed": eval_config.seed,
        "eval_prompts": eval_config.num_prompts,
        "val_split_fraction": cfg.evaluation.val_split_fraction,
        "samples_per_prompt": eval_config.samples_per_prompt,
        "pass_k": list(eval_config.pass_k),
        "correct_threshold": eval_config.correct_threshold,
        "sampling": sampling.model_dump(exclude={"ignore_eos"}),
        "seconds": seconds,
        "dump": None if dump is None else str(dump),
        "environments": [
            environment_numbers(result, eval_config.correct_threshold) for result in results
        ],
        "metrics": eval_metrics(results),
    }


def environment_numbers(result: EnvEvaluation, threshold: float) -> dict[str, Any]:
    """One environment's numbers; the greedy accuracy is the share of greedy rollouts (one per
    problem) that are no placeholder and whose reward is >= ``threshold``."""
    greedy = [r for r in result.records if r["pass"] == "greedy"]
    correct = sum(1 for r in greedy if r["error"] is None and r["reward"] >= threshold)
    low, high = wilson_interval(correct, len(greedy))
    return {
        "env_id": result.env_id,
        "prompts": result.prompts,
        "greedy_reward": result.greedy_reward,
        "greedy_correct": correct,
        "greedy_accuracy": correct / len(greedy),
        "greedy_accuracy_ci95": [low, high],
        "sample_reward": result.sample_reward,
        "pass_at_k": {str(k): v for k, v in sorted(result.pass_at_k.items())},
        "greedy_response_length_mean": result.greedy_lengths.mean,
        "greedy_response_length_max": result.greedy_lengths.max,
        "greedy_truncated_fraction": result.greedy_lengths.truncated_fraction,
        "sample_response_length_mean": result.sample_lengths.mean,
        "sample_response_length_max": result.sample_lengths.max,
        "sample_truncated_fraction": result.sample_lengths.truncated_fraction,
        "failed": result.failed,
        "seconds": result.seconds,
    }


def report(numbers: dict[str, Any]) -> str:
    """The table of ``summary``'s environments and a line on how they were measured."""
    envs = numbers["environments"]
    header = ["environment", "prompts", "greedy reward", "greedy accuracy [95% CI]"]
    header += ["sample reward", *(f"pass@{k}" for k in numbers["pass_k"])]
    header += ["length greedy/sample", "truncated greedy/sample", "failed", "seconds"]
    rows = [
        [
            env["env_id"],
            str(env["prompts"]),
            f"{env['greedy_reward']:.3f}",
            "{:.3f} [{:.3f}, {:.3f}]".format(env["greedy_accuracy"], *env["greedy_accuracy_ci95"]),
            f"{env['sample_reward']:.3f}",
            *(f"{env['pass_at_k'][str(k)]:.3f}" for k in numbers["pass_k"]),
            f"{env['greedy_response_length_mean']:.1f} / {env['sample_response_length_mean']:.1f}",
            f"{env['greedy_truncated_fraction']:.2f} / {env['sample_truncated_fraction']:.2f}",
            str(env["failed"]),
            f"{env['seconds']:.1f}",
        ]
        for env in envs
    ]
    sampling = numbers["sampling"]
    lines = [
        f"evaluated    {numbers['checkpoint']} (policy version {numbers['policy_version']}) on "
        f"{len(envs)} environment(s) in {numbers['seconds']:.1f} s",
        format_table(header, rows),
        f"accuracy: greedy responses with reward >= {numbers['correct_threshold']:g}; sampled: "
        f"{numbers['samples_per_prompt']} per prompt at temperature {sampling['temperature']:g}"
        f" (top-p {sampling['top_p']:g}, top-k {sampling['top_k']}); lengths in generated tokens",
    ]
    if numbers["dump"] is not None:
        lines.append(f"rollouts     {numbers['dump']}")
    return "\n".join(lines)


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Columns as wide as their widest cell: the first left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        return "  ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:]))])

    return "\n".join(line(row) for row in (header, *rows))


def write_json(path: Path, numbers: dict[str, Any]) -> None:
    """Write ``numbers`` to ``path`` (replaced atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(numbers, indent=2) + "\n", encoding="utf-8")
    os.replace(partial, path)


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, then evaluate."""
    evaluate(*parse_evaluate_args(argv))


if __name__ == "__main__":
    run_main(main, prog=PROG)
