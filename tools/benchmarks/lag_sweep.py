"""Lag sweep: training throughput of ``pretrain_grpo.py`` for forced lag L in {0, 1, 2, 4}.

    python tools/benchmarks/lag_sweep.py [--lags 0 1 2 4 --steps 40 --skip 15 --rounds 2]

Measures, for each L, on the long-tail + slow-reward workload (``envs.LongTailLatencyEnvironment``:
Pareto token budgets, min 4, shape 1.2, capped at 192; a log-uniform 20-200 ms asyncio reward per
rollout), with the trainer's default tiny model (2 layers, hidden 64), 8 prompts x 8 samples:

* steps/s: training steps per wall-clock second over steps ``skip..steps-1`` (the first ``skip``
  steps hold start-up, pipeline fill and the policy learning to stop emitting EOS early, after
  which every L generates nearly the same tokens: compare the tokens per step);
* generated tokens/s: tokens the engine sampled over the same window / its wall time;
* mean active requests: requests decoded per engine step (every active request steps in a
  generation window), sampled in-process by wrapping ``StepGroup.step``; also engine steps per
  training step and the share of wall time spent in engine steps;
* each ratio to L=0.

The trainer runs its deterministic schedule (``--rl-deterministic-schedule``, the default: a
window steps later batches only while the awaited batch has unfinished generations) with a
reward-wait budget (``--rl-reward-wait-steps``, ``--reward-wait-steps`` here, default 64: about
the engine steps that fit in the awaited batch's last reward wait): once the awaited batch has
finished generating, later batches step for that many more engine steps before the trainer takes
the batch, whatever the reward timing. How 64 was chosen: with a budget of 32 the trainer still
waited ~49 ms a step with the engine idle (29% of 0.170 s) at ~1.3 ms an engine step, room for
~37 more steps; measured side by side (2 rounds, quiet machine, 2026-11-25) budgets 32 / 64 / 96
/ 128 gave 1.84x / 1.94x / 1.91x / 1.81x the steps/s of L=0: past the wait, extra steps only
thin out the rows per step. One extra configuration per ``--throughput-lags`` entry
(default: L=2) runs ``--no-rl-deterministic-schedule`` (every batch in flight steps whenever a
window is open, also while the awaited batch's rewards are computed): it shows what the
deterministic schedule still costs. ``--compare-reward-wait-steps K ...`` adds deterministic
runs of those lags with other budgets (``0``: the schedule without a budget), interleaved with the
rest. Every run trains with ``--rl-use-sequence-packing`` (``--no-sequence-packing``: padded
micro-batches), the setting for long-tailed lengths: a padded micro-batch costs its longest
rollout in every row.

``--streaming-lags L ...`` adds runs streaming groups (Megatron-LM's ``--rl-submission-granularity
G``) at those generation lags, consumed as batches (G/B) and as groups (G/G), beside the B/B runs
of ``--lags`` (the same lag there is ``--rl-forced-lag``).

Every configuration runs ``rounds`` times as separate ``torchrun`` processes, interleaved (order
reversed every other round), so all see the same machine conditions; numbers pool the rounds and
the steps/s ratio is also given per round (min-max). The engine has 320 KV-cache slots
(``--inference-max-requests``) in every run: room for the L+1 = 5 batches in flight at L=4.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchmarks.common import Window, pooled, run_trainer, spread, window  # noqa: E402

ENV_CONFIG = """\
- agent_type: tools.benchmarks.envs:LongTailLatencyEnvironment
  env_id: longtail
  agent_args: {{budget_min: 4, budget_alpha: {alpha}, budget_max: {cap},
               latency_min_ms: 20, latency_max_ms: 200}}
"""


def trainer_flags(
    lag: list[str],
    opts: argparse.Namespace,
    env_config: Path,
    deterministic: bool = True,
    reward_wait_steps: int | None = None,
) -> list[str]:
    """``pretrain_grpo.py`` flags of one sweep run (model and batch: the trainer's defaults):
    ``lag``, the streaming mode's flags, first; ``reward_wait_steps`` overrides
    ``--reward-wait-steps``."""
    budget = opts.reward_wait_steps if reward_wait_steps is None else reward_wait_steps
    return [
        *lag,
        "--train-iters",
        str(opts.steps),
        "--env-config",
        str(env_config),
        "--seq-length",
        str(opts.budget_max + 16),  # prompts are at most 5 tokens
        "--inference-max-requests",
        str(opts.slots),
        "--lr-warmup-iters",
        "0",
        "--lr-decay-style",
        "constant",
        "--micro-batch-size",
        str(opts.micro_batch_size),
        "--log-interval",
        str(opts.steps),
        *(["--rl-use-sequence-packing"] if opts.sequence_packing else []),
        *(
            ["--rl-reward-wait-steps", str(budget)]
            if deterministic
            else ["--no-rl-deterministic-schedule"]
        ),
    ]


def describe(w: Window) -> dict[str, float | None]:
    """The reported numbers of one (pooled) window."""
    c = w.counters
    engine_steps = max(c["engine_steps"], 1)
    return {
        "steps_per_s": w.steps_per_s,
        "seconds_per_step": w.seconds_per_step,
        "uncontended_steps_per_s": w.uncontended_steps_per_s,
        "runq_fraction": w.runq_fraction,
        "generated_tokens_per_s": c["generated_tokens"] / w.seconds,
        "generated_tokens_per_step": c["generated_tokens"] / w.steps,
        "mean_active_requests": c["engine_rows"] / engine_steps,
        "engine_steps_per_step": c["engine_steps"] / w.steps,
        "engine_prefill_step_fraction": c["engine_prefill_steps"] / engine_steps,
        "engine_busy_fraction": c["engine_seconds"] / w.seconds,
        "waiting_fraction": (c["collect_seconds"] - c["engine_seconds"]) / w.seconds,
        "train_fraction": c["train_seconds"] / w.seconds,
        "completion_tokens_mean": w.completion_tokens_mean,
    }


def forced(lag: int) -> list[str]:
    """The flags of forced lag ``lag`` (B/B)."""
    return ["--rl-forced-lag", str(lag)]


def streamed(consumption: str, lag: float) -> list[str]:
    """The flags of G submission, ``consumption`` and generation lag ``lag``."""
    return [
        "--rl-partial-rollouts",
        "--rl-submission-granularity",
        "G",
        "--rl-consumption-granularity",
        consumption,
        "--rl-generation-lag",
        f"{lag:g}",
    ]


def configurations(opts: argparse.Namespace) -> list[tuple[str, list[str], bool, int | None]]:
    """(name, lag flags, deterministic schedule, reward-wait budget override) of every run; the
    first is the reference."""
    deterministic = [(f"L={lag}", forced(lag), True, None) for lag in opts.lags]
    budgets = [
        (f"L={lag}, reward wait {k}", forced(lag), True, k)
        for k in opts.compare_reward_wait_steps
        for lag in opts.throughput_lags
    ]
    throughput = [
        (f"L={lag}, throughput", forced(lag), False, None) for lag in opts.throughput_lags
    ]
    streaming = [
        (f"{mode} L={lag:g}", streamed(mode[-1], lag), True, None)
        for lag in opts.streaming_lags
        for mode in ("G/B", "G/G")
        if mode == "G/G" or lag >= 0
    ]
    return deterministic + budgets + throughput + streaming


def run(opts: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """Run the interleaved sweep; returns per-configuration results, ratios and the flags."""
    logs.mkdir(parents=True, exist_ok=True)
    env_config = logs / "longtail_env.yaml"
    env_config.write_text(ENV_CONFIG.format(alpha=opts.budget_alpha, cap=opts.budget_max))
    configs = configurations(opts)
    windows: dict[str, list[Window]] = {name: [] for name, *_ in configs}
    for r in range(opts.rounds):
        for name, lag, deterministic, budget in configs if r % 2 == 0 else configs[::-1]:
            flags = trainer_flags(lag, opts, env_config, deterministic, budget)
            stem = name.replace("=", "").replace(", ", "_").replace("/", "").replace(" ", "_")
            log = logs / f"{stem}_round{r}.log"
            print(f"  lag sweep: round {r + 1}/{opts.rounds}, {name}", flush=True)
            summary = run_trainer(flags, opts.threads, log)
            windows[name].append(window(summary, opts.skip))
    base = windows[configs[0][0]]
    results = []
    for name, lag, deterministic, _ in configs:
        row = {"name": name, "lag": " ".join(lag), "deterministic": deterministic}
        row.update(describe(pooled(windows[name])))
        row["steps_per_s_ratio_per_round"] = [
            w.steps_per_s / b.steps_per_s for w, b in zip(windows[name], base)
        ]
        results.append(row)
    ref = results[0]
    for row in results:
        for key in (
            "steps_per_s",
            "uncontended_steps_per_s",
            "generated_tokens_per_s",
            "mean_active_requests",
        ):
            ok = row[key] is not None and ref[key] is not None
            row[f"{key}_ratio"] = row[key] / ref[key] if ok else None
    return {
        "flags": trainer_flags([], opts, Path("longtail_env.yaml")),
        "env_config": env_config.read_text(),
        "steps": opts.steps,
        "skip": opts.skip,
        "rounds": opts.rounds,
        "threads": opts.threads,
        "results": results,
    }


def markdown(res: dict[str, Any]) -> str:
    """The sweep as a markdown table."""
    lines = [
        "| config | steps/s | ratio to L=0 (per round) | ratio without run-queue wait"
        " | generated tok/s | ratio | mean active requests | ratio"
        " | engine steps per step (with prefill) | time in engine / waiting / training"
        " | run-queue wait | s/step | gen tok/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["results"]:
        unc = (
            "n/a"
            if r["uncontended_steps_per_s_ratio"] is None
            else (f"{r['uncontended_steps_per_s_ratio']:.2f}x")
        )
        runq = "n/a" if r["runq_fraction"] is None else f"{r['runq_fraction']:.0%}"
        lines.append(
            f"| {r['name']} | {r['steps_per_s']:.2f} | **{r['steps_per_s_ratio']:.2f}x** "
            f"({spread(r['steps_per_s_ratio_per_round'])}) | {unc} | "
            f"{r['generated_tokens_per_s']:.0f} | {r['generated_tokens_per_s_ratio']:.2f}x | "
            f"{r['mean_active_requests']:.1f} | {r['mean_active_requests_ratio']:.2f}x | "
            f"{r['engine_steps_per_step']:.1f} ({r['engine_prefill_step_fraction']:.0%}) | "
            f"{r['engine_busy_fraction']:.0%} / {r['waiting_fraction']:.0%} / "
            f"{r['train_fraction']:.0%} | {runq} | {r['seconds_per_step']:.3f} | "
            f"{r['generated_tokens_per_step']:.0f} |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sweep's options (shared with ``run_all.py``)."""
    parser.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument(
        "--throughput-lags",
        type=int,
        nargs="*",
        default=[2],
        help="Extra runs with --no-rl-deterministic-schedule.",
    )
    parser.add_argument(
        "--reward-wait-steps",
        type=int,
        default=64,
        help="--rl-reward-wait-steps of the deterministic runs (0: no reward-wait budget).",
    )
    parser.add_argument(
        "--compare-reward-wait-steps",
        type=int,
        nargs="*",
        default=[],
        help="Extra deterministic runs of each --throughput-lags entry with these budgets.",
    )
    parser.add_argument(
        "--streaming-lags",
        type=float,
        nargs="*",
        default=[],
        help="Extra runs streaming groups (--rl-submission-granularity G) at these generation "
        "lags, consumed as batches (G/B, lags >= 0) and as groups (G/G).",
    )
    parser.add_argument("--steps", type=int, default=40, help="Training steps per run.")
    parser.add_argument("--skip", type=int, default=15, help="Leading steps not measured.")
    parser.add_argument("--rounds", type=int, default=2, help="Interleaved repetitions.")
    parser.add_argument("--slots", type=int, default=320, help="--inference-max-requests.")
    parser.add_argument("--budget-alpha", type=float, default=1.2, help="Pareto shape.")
    parser.add_argument("--budget-max", type=int, default=192, help="Longest token budget.")
    parser.add_argument("--micro-batch-size", type=int, default=32, help="Trainer micro-batch.")
    parser.add_argument("--threads", type=int, default=1, help="Torch threads per process.")
    parser.add_argument(
        "--sequence-packing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Train with --rl-use-sequence-packing (every L alike).",
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
