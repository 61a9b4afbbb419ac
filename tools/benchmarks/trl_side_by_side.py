"""Side by side: TRL's ``GRPOTrainer`` vs ``pretrain_grpo.py --rl-forced-lag 0`` and ``2`` on CPU.

    python tools/benchmarks/trl_side_by_side.py [--steps 40 --skip 10 --rounds 2]

Measures wall-clock seconds per GRPO step (one optimizer update on prompts x group-size
completions) of each trainer on the same problem: the same model shape and parameter count
(the trainer's default 2 layers, hidden 64, 4 heads, MLP 256, padded vocabulary 128, 32
positions; random init), the digit-copy prompts and partial-credit reward, 8 prompts x 8
samples per step, exactly 16 new tokens per completion (equal work: EOS ends no completion, ours
with ``--rl-ignore-eos``, TRL with ``generate``'s ``min_new_tokens``), temperature 1,
micro-batches of 32, learning rate 3e-3 (constant), clip 0.2/0.28, no KL term, and the same
number of steps. Seconds per step are measured between the end of step ``skip - 1``
and the end of the last step (start-up and warm-up excluded) from timestamps taken inside each
process (TRL: a ``TrainerCallback.on_step_end``; ours: ``MetricsWriter.write``).

Configurations, run as separate processes, interleaved over ``rounds`` (order reversed every
other round):

* ``trl``: ``trl_worker.py`` (TRL ``GRPOTrainer``, HF ``generate`` with its KV cache);
* ``ours L=0`` and ``ours L=2``: ``pretrain_grpo.py``'s ``train`` under ``torchrun``, 192
  KV-cache slots (``--inference-max-requests 192``: room for the 3 batches in flight at L=2);
* ``ours L=2, 64 slots``: the default ``--inference-max-requests 64``, for reference.

With ``--hf-shape 1m|25m`` both sides train the same random Llama checkpoint and tokenizer
(``hf_shapes.SHAPES``, written with ``make_tiny_hf_checkpoint``'s library): TRL loads it with
``from_pretrained``, ours with ``--hf-checkpoint``; prompts, group size, token budget, reward and
settings are as above (the reference row with 64 slots is left out). Each process's peak RSS
(``ru_maxrss``) is reported beside its timing.

The result is each trainer's wall seconds per step and the ratio TRL / ours (> 1: ours is
faster), pooled over rounds, with the per-round range. Two contention-robust cross-checks come
with it: the same ratio of wall time minus the main thread's run-queue wait (time it was ready
to run but other jobs held the cores), and of the main thread's CPU time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchmarks.common import (  # noqa: E402
    COUNTERS,
    REPO,
    Window,
    clock_window,
    pooled,
    run_trainer,
    spread,
    subprocess_env,
    window,
)

ENV_CONFIG = """\
- agent_type: tools.benchmarks.envs:FixedBudgetDigits
  env_id: copy
  agent_args: {task: copy}
"""

CONFIGS: list[tuple[str, int | None, int]] = [
    ("trl", None, 0),
    ("ours L=0", 0, 192),
    ("ours L=2", 2, 192),
    ("ours L=2, 64 slots", 2, 64),
]
"""(name, forced lag or None for TRL, --inference-max-requests)."""


def shared_flags(opts: argparse.Namespace, env_config: Path) -> list[str]:
    """``pretrain_grpo.py`` flags common to our runs: the settings TRL is given too."""
    return [
        "--train-iters",
        str(opts.steps),
        "--env-config",
        str(env_config),
        "--grpo-prompts-per-step",
        str(opts.prompts),
        "--grpo-group-size",
        str(opts.group_size),
        "--rl-default-max-tokens",
        str(opts.max_new_tokens),
        "--rl-ignore-eos",
        "--micro-batch-size",
        "32",
        "--lr",
        "3e-3",
        "--lr-warmup-iters",
        "0",
        "--lr-decay-style",
        "constant",
        "--log-interval",
        str(opts.steps),
    ]


def ours_flags(
    lag: int, slots: int, opts: argparse.Namespace, env_config: Path, ckpt: Path | None = None
) -> list[str]:
    """All flags of one of our runs (model: the trainer's defaults, or ``--hf-checkpoint``)."""
    model = [] if ckpt is None else ["--hf-checkpoint", str(ckpt)]
    return [
        "--rl-forced-lag",
        str(lag),
        "--inference-max-requests",
        str(slots),
        *model,
        *shared_flags(opts, env_config),
    ]


def run_trl(
    opts: argparse.Namespace, log: Path, workdir: Path, ckpt: Path | None = None
) -> tuple[Window, float]:
    """Timing of one TRL run over its measured steps, and its peak RSS (MiB)."""
    summary = workdir / "trl_summary.json"
    cmd = [
        sys.executable,
        str(REPO / "tools" / "benchmarks" / "trl_worker.py"),
        "--summary",
        str(summary),
        "--steps",
        str(opts.steps),
        "--prompts",
        str(opts.prompts),
        "--group-size",
        str(opts.group_size),
        "--max-new-tokens",
        str(opts.max_new_tokens),
        "--ignore-eos",
    ]
    if ckpt is not None:
        cmd += ["--hf-checkpoint", str(ckpt)]
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.run(
            cmd,
            cwd=workdir,
            env=subprocess_env(opts.threads),
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=1800,
            check=False,
        )
    if proc.returncode != 0:
        tail = "".join(log.read_text(encoding="utf-8").splitlines(keepends=True)[-30:])
        raise RuntimeError(f"TRL run failed ({proc.returncode})\n{tail}")
    data = json.loads(summary.read_text())
    if len(data["steps"]) != opts.steps:
        raise RuntimeError(f"TRL ran {len(data['steps'])} steps, expected {opts.steps}")
    steps, wall, cpu, runq = clock_window(data["steps"], opts.skip)
    lengths = data["completion_tokens_mean"][opts.skip :] or [float("nan")]
    window_ = Window(
        steps, wall, cpu, runq, dict.fromkeys(COUNTERS, 0.0), statistics.fmean(lengths)
    )
    return window_, data["peak_rss_mib"]


def run(opts: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """Run every configuration ``rounds`` times, interleaved; returns seconds per step."""
    logs.mkdir(parents=True, exist_ok=True)
    env_config = logs / "copy_env.yaml"
    env_config.write_text(ENV_CONFIG)
    ckpt, params, configs = None, None, CONFIGS
    if opts.hf_shape is not None:
        from tools.benchmarks.hf_shapes import SHAPES, write_checkpoint

        ckpt = write_checkpoint(opts.hf_shape, logs / f"llama-{opts.hf_shape}")
        params = dict(SHAPES[opts.hf_shape])
        configs = [c for c in CONFIGS if c[2] != 64]  # the reference row only at the tiny shape
    runs: dict[str, list[Window]] = {name: [] for name, _, _ in configs}
    rss: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    for r in range(opts.rounds):
        order = configs if r % 2 == 0 else list(reversed(configs))
        for name, lag, slots in order:
            print(f"  TRL side by side: round {r + 1}/{opts.rounds}, {name}", flush=True)
            log = logs / f"{name.replace(' ', '_').replace(',', '').replace('=', '')}_{r}.log"
            if lag is None:
                w, peak = run_trl(opts, log, logs, ckpt)
                runs[name].append(w)
                rss[name].append(peak)
            else:
                flags = ours_flags(lag, slots, opts, env_config, ckpt)
                summary = run_trainer(flags, opts.threads, log, timeout_s=1800)
                runs[name].append(window(summary, opts.skip))
                rss[name].append(summary["peak_rss_mib"])
    trl, trl_runs = pooled(runs["trl"]), runs["trl"]
    results = []
    for name, lag, slots in configs:
        w = pooled(runs[name])
        row: dict[str, Any] = {
            "name": name,
            "lag": lag,
            "slots": slots if lag is not None else None,
            "peak_rss_mib": max(rss[name]),
            "seconds_per_step": w.seconds_per_step,
            "seconds_per_step_per_round": [x.seconds_per_step for x in runs[name]],
            "speedup_vs_trl": trl.seconds_per_step / w.seconds_per_step,
            "speedup_vs_trl_per_round": [
                t.seconds_per_step / x.seconds_per_step for t, x in zip(trl_runs, runs[name])
            ],
            "cpu_seconds_per_step": w.cpu_seconds / w.steps,
            "cpu_speedup_vs_trl": trl.cpu_seconds / trl.steps / (w.cpu_seconds / w.steps),
            "runq_fraction": w.runq_fraction,
            "completion_tokens_mean": w.completion_tokens_mean,
        }
        if lag is not None:  # the training step alone bounds the speedup (see ``markdown``)
            row["train_seconds_per_step"] = w.counters["train_seconds"] / w.steps
            row["training_ceiling_vs_trl"] = trl.seconds_per_step / row["train_seconds_per_step"]
        if w.runq_seconds is not None and trl.runq_seconds is not None:
            row["uncontended_seconds_per_step"] = 1.0 / w.uncontended_steps_per_s
            row["uncontended_speedup_vs_trl"] = (
                w.uncontended_steps_per_s / trl.uncontended_steps_per_s
            )
        results.append(row)
    return {
        "hf_shape": opts.hf_shape,
        "architecture": params,
        "flags": shared_flags(opts, Path("copy_env.yaml")),
        "steps": opts.steps,
        "skip": opts.skip,
        "rounds": opts.rounds,
        "threads": opts.threads,
        "prompts": opts.prompts,
        "group_size": opts.group_size,
        "results": results,
    }


def markdown(res: dict[str, Any]) -> str:
    """The comparison as a markdown table.

    *Training s/step*: our step's time in the optimizer update alone (forward, backward,
    optimizer; wall clock). TRL s/step ÷ it is the speedup ours would reach if generation cost
    nothing: a ceiling that no lag or engine change can pass.
    """
    lines = [
        "| trainer | s/step | per round | TRL s/step ÷ this (per round) | without run-queue wait:"
        " s/step, TRL ÷ this | CPU s/step, TRL ÷ this | run-queue wait | completion tokens |"
        " generated tokens/step | peak RSS | training s/step (TRL s/step ÷ it) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rollouts = res.get("prompts", 8) * res.get("group_size", 8)
    for r in res["results"]:
        rounds = ", ".join(f"{s:.3f}" for s in r["seconds_per_step_per_round"])
        unc = (
            f"{r['uncontended_seconds_per_step']:.3f}, {r['uncontended_speedup_vs_trl']:.2f}x"
            if "uncontended_seconds_per_step" in r
            else "n/a"
        )
        runq = "n/a" if r["runq_fraction"] is None else f"{r['runq_fraction']:.0%}"
        lines.append(
            f"| {r['name']} | {r['seconds_per_step']:.3f} | {rounds} | "
            f"**{r['speedup_vs_trl']:.2f}x** ({spread(r['speedup_vs_trl_per_round'])}) | {unc} | "
            f"{r['cpu_seconds_per_step']:.3f}, {r['cpu_speedup_vs_trl']:.2f}x | {runq} | "
            f"{r['completion_tokens_mean']:.1f} | {r['completion_tokens_mean'] * rollouts:.0f} | "
            + ("n/a" if r.get("peak_rss_mib") is None else f"{r['peak_rss_mib']:.0f} MiB")
            + " | "
            + (
                f"{r['train_seconds_per_step']:.3f} ({r['training_ceiling_vs_trl']:.2f}x)"
                if "train_seconds_per_step" in r
                else "n/a"
            )
            + " |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The comparison's options (shared with ``run_all.py``)."""
    parser.add_argument("--steps", type=int, default=40, help="GRPO steps per run.")
    parser.add_argument("--skip", type=int, default=10, help="Leading steps not measured.")
    parser.add_argument("--rounds", type=int, default=2, help="Interleaved repetitions.")
    parser.add_argument("--prompts", type=int, default=8, help="Prompts per step.")
    parser.add_argument("--group-size", type=int, default=8, help="Samples per prompt.")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="Completion budget.")
    parser.add_argument("--threads", type=int, default=1, help="Torch threads per process.")
    parser.add_argument(
        "--hf-shape",
        choices=("1m", "25m"),
        default=None,
        help="Both trainers on this random Llama checkpoint (hf_shapes.SHAPES) instead of the "
        "tiny GPT-2 shape.",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument("--json", type=Path, default=None, help="Also write the results here.")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        res = run(opts, Path(tmp))
    print(markdown(res))
    if opts.json:
        opts.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
