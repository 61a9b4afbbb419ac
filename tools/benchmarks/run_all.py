"""Regenerates every benchmark result: engine throughput, TRL side by side, lag sweep, and the
engine and matmul efficiency on Llama-style Hugging Face checkpoints.

    pip install torch==2.13.0 -e '.[bench]'
    python tools/benchmarks/run_all.py            # about 12 minutes on 2 CPU cores
    python tools/benchmarks/run_all.py --only hf_shapes   # re-measure one benchmark

Runs ``engine_throughput.py``, ``trl_side_by_side.py``, ``lag_sweep.py`` and ``hf_shapes.py``
(see their docstrings for what each measures) one after another in this single invocation, then
writes

* ``benchmarks/results/RESULTS.md``: the machine, the commands, one markdown table per benchmark
  and whether the targets of issue 7 were met;
* ``benchmarks/results/benchmarks.png``: the ratios as bar charts (absolute times are in the
  tables, never used as bars);
* ``benchmarks/results/results.json``: every number, for diffs between runs.

Every comparison inside a benchmark is measured side by side (interleaved runs in this one
invocation); ratios, not absolute times, are what the targets are checked against.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchmarks import engine_throughput, hf_shapes, lag_sweep, trl_side_by_side  # noqa: E402
from tools.benchmarks.common import REPO, machine, spread, subprocess_env  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
LAG_TARGET = 2.0
"""Issue 7: L=2 must reach this many times the steps/s of L=0."""
HF_TARGET, SERIAL_TARGET = 1.3, 5.0
"""Issue 17: engine decode tokens/s vs HF generate and vs one request at a time."""
DETERMINISTIC_LAG_TARGET, THROUGHPUT_LAG_TARGET = 1.9, 2.3
"""Issue 17: L=2 steps/s over L=0 with the deterministic (reward-wait budget) and throughput
schedules."""
"""Issue 17: engine tokens/s at batch 64 over HF ``generate`` / over one request at a time."""
DECODE_MATMUL_TARGET, TRAIN_MATMUL_TARGET = 0.25, 0.50
"""Issue 17: share of the measured matmul rate reached by decode / by a training step (~25M)."""
TRL_L0_TARGET, TRL_L2_TARGET = 1.3, 2.0
"""Issue 17: TRL s/step over ours at L=0 / at L=2 on the same HF checkpoint."""
BENCHMARKS = ("engine", "trl", "lag_sweep", "hf_shapes", "trl_hf")


def run_engine(opts: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """``engine_throughput.py`` in its own process (it initializes torch.distributed)."""
    out = workdir / "engine.json"
    cmd = [
        sys.executable, str(REPO / "tools" / "benchmarks" / "engine_throughput.py"),
        "--json", str(out), "--threads", str(opts.threads), "--repeats", str(opts.engine_repeats),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=REPO, env=subprocess_env(opts.threads), capture_output=True, text=True,
        timeout=600, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(
            f"engine_throughput.py failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    return json.loads(out.read_text())


def run_hf_shapes(opts: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """``hf_shapes.py`` in its own process (it initializes torch.distributed)."""
    out = workdir / "hf_shapes.json"
    cmd = [
        sys.executable, str(REPO / "tools" / "benchmarks" / "hf_shapes.py"),
        "--json", str(out), "--threads", str(opts.threads), "--repeats", str(opts.hf_repeats),
    ]  # fmt: skip
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    load = os.getloadavg()
    proc = subprocess.run(
        cmd, cwd=REPO, env=subprocess_env(opts.threads), capture_output=True, text=True,
        timeout=1800, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"hf_shapes.py failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return {**json.loads(out.read_text()), "started": started, "load_average_at_start": load}


def _ratio_bars(ax, rows: list[dict], series: list[tuple[str, str]], spread_key: str) -> None:
    """Grouped bars of ``series`` (key, label) per row; the first gets per-round error bars."""
    width = 0.8 / len(series)
    for k, (key, label) in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(rows))]
        vals = [r[key] if r.get(key) is not None else 0.0 for r in rows]
        bars = ax.bar(xs, vals, width, label=label)
        if k == 0:
            lo = [v - min(r[spread_key]) for v, r in zip(vals, rows)]
            hi = [max(r[spread_key]) - v for v, r in zip(vals, rows)]
            ax.errorbar(xs, vals, yerr=[lo, hi], fmt="none", c="k", lw=1)
        if k in (0, len(series) - 1):  # the table has every number; keep the chart legible
            ax.bar_label(bars, fmt="%.2f", fontsize=6)


def plot(res: dict[str, Any], path: Path) -> None:
    """Three bar charts of ratios: lag sweep, engine throughput, TRL side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(27, 5.2))

    ax = axes[0]
    rows = res["lag_sweep"]["results"]
    series = [
        ("steps_per_s_ratio", "steps/s (wall clock)"),
        ("uncontended_steps_per_s_ratio", "steps/s without run-queue wait"),
        ("generated_tokens_per_s_ratio", "generated tokens/s"),
        ("mean_active_requests_ratio", "mean active requests"),
    ]
    _ratio_bars(ax, rows, series, "steps_per_s_ratio_per_round")
    ax.axhline(LAG_TARGET, ls="--", c="r", lw=1, label=f"target: L=2 steps/s {LAG_TARGET}x")
    ax.axhline(1.0, c="gray", lw=0.8)
    ax.set_xticks(range(len(rows)), [r["name"].replace(", ", "\n") for r in rows])
    ax.set_ylabel("ratio to L=0")
    ax.set_title("Lag sweep (long-tail lengths, 20-200 ms reward)", fontsize=10)
    ax.legend(fontsize=7)

    ax = axes[1]
    rows = res["engine"]["results"]
    rel = [1.0 / r["engine_b64_over_this"] for r in rows]
    bars = ax.bar(range(len(rows)), rel, color="tab:green")
    ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(range(len(rows)), [r["name"].replace(", ", "\n") for r in rows], fontsize=7)
    ax.set_ylabel("tokens/s relative to the engine at batch 64 (log)")
    ax.set_title(f"Generation throughput ({res['engine']['new_tokens']} new tokens)", fontsize=10)

    ax = axes[2]
    rows = res["trl"]["results"]
    series = [
        ("speedup_vs_trl", "wall clock"),
        ("uncontended_speedup_vs_trl", "without run-queue wait"),
        ("cpu_speedup_vs_trl", "CPU time"),
    ]
    _ratio_bars(ax, rows, series, "speedup_vs_trl_per_round")
    ax.axhline(1.0, ls="--", c="r", lw=1, label="TRL (target: ours above it at L=2)")
    ax.set_xticks(range(len(rows)), [r["name"].replace(", ", "\n") for r in rows], fontsize=7)
    ax.set_ylabel("TRL s/step ÷ s/step  (> 1: faster than TRL)")
    ax.set_title("GRPO step time vs TRL GRPOTrainer (8 x 8, 16 tokens)", fontsize=10)
    ax.legend(fontsize=7)

    ax = axes[3]
    if "hf_shapes" in res:
        _hf_shapes_bars(ax, res["hf_shapes"])
    else:
        ax.set_axis_off()

    ax = axes[4]
    if "trl_hf" in res:
        _trl_hf_bars(ax, res["trl_hf"])
    else:
        ax.set_axis_off()

    m = res["machine"]
    fig.suptitle(
        f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, {res['threads']} torch thread(s) "
        f"per process; error bars: per-round range; all measured side by side in one run "
        f"({res['started']})"
        + (
            f"; panels 4-5 in a later run ({res['hf_shapes']['started']})"
            if "hf_shapes" in res and res["hf_shapes"]["started"] != res["started"]
            else ""
        ),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _hf_shapes_bars(ax, hfs: dict[str, Any]) -> None:
    """Engine batch-64 tokens/s over HF generate and over one at a time, per Llama shape (CPU
    time: the targets are judged on it; wall-clock ratios are in the tables)."""
    b = hfs["batch"]
    groups = [(f"HF generate, batch {b}", f"÷ HF generate (target {HF_TARGET}x)"),
              ("engine, one at a time", f"÷ one at a time (target {SERIAL_TARGET}x)")]  # fmt: skip
    shapes = hfs["shapes"]
    width = 0.8 / len(groups)
    for k, (name, label) in enumerate(groups):
        rows = [next(r for r in s["results"] if r["name"] == name) for s in shapes]
        xs = [i + (k - (len(groups) - 1) / 2) * width for i in range(len(shapes))]
        vals = [r["cpu_engine_batch_over_this"] for r in rows]  # what the targets judge
        bars = ax.bar(xs, vals, width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.axhline(HF_TARGET, ls="--", c="r", lw=1)
    ax.axhline(1.0, c="gray", lw=0.8)
    ax.set_yscale("log")
    labels = [f"Llama {s['shape'].upper()}\n({s['parameters']['ours'] / 1e6:.1f}M)" for s in shapes]
    ax.set_xticks(range(len(shapes)), labels, fontsize=8)
    ax.set_ylabel(f"engine batch-{b} tokens/s ÷ this, in CPU time (log)")
    ax.set_title("Engine on HF checkpoints (same weights; CPU time)", fontsize=10)
    ax.legend(fontsize=7)


def _trl_hf_bars(ax, trl_hf: dict[str, Any]) -> None:
    """TRL s/step over ours at L=0 and L=2 on each HF checkpoint, in CPU time, with the targets."""
    shapes = list(trl_hf)
    series = [("ours L=0", TRL_L0_TARGET), ("ours L=2", TRL_L2_TARGET)]
    width = 0.8 / len(series)
    for k, (name, target) in enumerate(series):
        rows = [next(r for r in trl_hf[s]["results"] if r["name"] == name) for s in shapes]
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(shapes))]
        vals = [r["cpu_speedup_vs_trl"] for r in rows]  # what the targets judge
        bars = ax.bar(xs, vals, width, label=f"{name} (target {target}x)")
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
        for x in xs:
            ax.plot([x - width / 2, x + width / 2], [target, target], c="r", ls="--", lw=1)
    ax.axhline(1.0, c="gray", lw=0.8)
    ax.set_xticks(range(len(shapes)), [f"Llama {s.upper()}" for s in shapes], fontsize=8)
    ax.set_ylabel("TRL CPU s/step ÷ ours  (> 1: faster than TRL)")
    ax.set_title("GRPO step vs TRL on HF checkpoints (CPU time; red: targets)", fontsize=10)
    ax.legend(fontsize=7)


def hf_targets(hfs: dict[str, Any]) -> list[str]:
    """One line per issue-17 target that ``hf_shapes.py`` measures, met or not."""
    lines = []
    b = hfs["batch"]
    for s in hfs["shapes"]:
        rows = {r["name"]: r for r in s["results"]}
        label = f"Llama {s['shape'].upper()} ({s['parameters']['ours']:,} parameters)"
        for name, target, what in (
            (f"HF generate, batch {b}", HF_TARGET, f"HF `generate` at batch {b}"),
            ("engine, one at a time", SERIAL_TARGET, "the engine one request at a time"),
        ):
            r = rows[name]
            v, unc = r["engine_batch_over_this"], r["uncontended_engine_batch_over_this"]
            judged = r["cpu_engine_batch_over_this"]
            lines.append(
                f"- {label}: engine batch-{b} tokens/s >= {target}x {what}: "
                f"**{'met' if judged >= target else 'not met'}**: {judged:.2f}x in CPU time "
                f"(wall clock {v:.2f}x, repeats {spread(r['engine_batch_over_this_rounds'])}"
                + ("" if unc is None else f"; {unc:.2f}x without run-queue wait")
                + ")."
            )
        m = s.get("matmul")
        if m and s["shape"] == "25m":
            for key, target, what in (
                ("train_fraction", TRAIN_MATMUL_TARGET, "a training step"),
                ("decode_fraction", DECODE_MATMUL_TARGET, f"engine decode at batch {b}"),
            ):
                lines.append(
                    f"- {label}: {what} reaches >= {target:.0%} of the measured matmul rate: "
                    f"**{'met' if m[key] >= target else 'not met'}**: {m[key]:.0%}."
                )
    return lines


def trl_hf_targets(trl_hf: dict[str, Any]) -> list[str]:
    """Issue 17's whole-step and memory targets against TRL on each HF checkpoint."""
    lines = []
    for shape, res in trl_hf.items():
        rows = {r["name"]: r for r in res["results"]}
        trl = rows["trl"]
        per_step = 64 if not res.get("prompts") else res["prompts"] * res["group_size"]
        for name, target in (("ours L=0", TRL_L0_TARGET), ("ours L=2", TRL_L2_TARGET)):
            r = rows[name]
            v, judged = r["speedup_vs_trl"], r["cpu_speedup_vs_trl"]
            per_token = judged * r["completion_tokens_mean"] / trl["completion_tokens_mean"]
            unc = r.get("uncontended_speedup_vs_trl")
            lines.append(
                f"- Llama {shape.upper()}: {name} whole GRPO step >= {target}x TRL: "
                f"**{'met' if judged >= target else 'not met'}**: TRL ÷ ours = {judged:.2f}x in "
                f"CPU s/step (wall clock {v:.2f}x, rounds {spread(r['speedup_vs_trl_per_round'])}"
                + ("" if unc is None else f"; {unc:.2f}x without run-queue wait")
                + f"; {r['completion_tokens_mean'] * per_step:.0f} vs "
                f"{trl['completion_tokens_mean'] * per_step:.0f} generated tokens per step, "
                f"{per_token:.2f}x per generated token in CPU time)."
            )
        worst = max(rows[n]["peak_rss_mib"] for n in ("ours L=0", "ours L=2"))
        lines.append(
            f"- Llama {shape.upper()}: peak RSS ours <= TRL: "
            f"**{'met' if worst <= trl['peak_rss_mib'] else 'not met'}**: ours "
            f"{rows['ours L=0']['peak_rss_mib']:.0f} MiB (L=0), "
            f"{rows['ours L=2']['peak_rss_mib']:.0f} MiB (L=2), TRL {trl['peak_rss_mib']:.0f} MiB."
        )
    return lines


def lag_targets(sweep: dict[str, Any]) -> list[str]:
    """Issue 17's lag-schedule targets: L=2 over L=0 under either schedule."""
    lags = {r["name"]: r for r in sweep["results"]}
    lines = []
    for name, schedule, target in (
        ("L=2", "deterministic (reward-wait budget)", DETERMINISTIC_LAG_TARGET),
        ("L=2, throughput", "throughput", THROUGHPUT_LAG_TARGET),
    ):
        if name not in lags:
            continue
        r = lags[name]
        lines.append(
            f"- L=2 steps/s >= {target}x L=0, {schedule} schedule: "
            f"**{'met' if r['steps_per_s_ratio'] >= target else 'not met'}**: "
            f"{r['steps_per_s_ratio']:.2f}x (rounds {spread(r['steps_per_s_ratio_per_round'])})."
        )
    return lines


def targets(res: dict[str, Any]) -> list[str]:
    """One line per target of issue 7, met or not, with the measured ratios."""
    lags = {r["name"]: r for r in res["lag_sweep"]["results"]}
    lines = []
    for name, schedule in (("L=2", "deterministic"), ("L=2, throughput", "throughput")):
        if name not in lags or "L=0" not in lags:
            continue
        r = lags[name]
        met = r["steps_per_s_ratio"] >= LAG_TARGET
        unc = r["uncontended_steps_per_s_ratio"]
        lines.append(
            f"- L=2 steps/s >= {LAG_TARGET}x L=0, {schedule} schedule: "
            f"**{'met' if met else 'not met'}**: {r['steps_per_s_ratio']:.2f}x "
            f"(rounds {spread(r['steps_per_s_ratio_per_round'])}"
            + ("" if unc is None else f"; {unc:.2f}x without run-queue wait")
            + ")."
        )
    trl = {r["name"]: r for r in res["trl"]["results"]}
    if "ours L=2" in trl:
        r = trl["ours L=2"]
        met = r["speedup_vs_trl"] > 1.0 and min(r["speedup_vs_trl_per_round"]) > 1.0
        unc = r.get("uncontended_speedup_vs_trl")
        lines.append(
            f"- ours faster than TRL at L=2: **{'met' if met else 'not met'}**: TRL s/step ÷ ours "
            f"= {r['speedup_vs_trl']:.2f}x (rounds {spread(r['speedup_vs_trl_per_round'])}"
            + ("" if unc is None else f"; {unc:.2f}x without run-queue wait")
            + f"; {r['cpu_speedup_vs_trl']:.2f}x in CPU time)."
        )
    return lines


def report(res: dict[str, Any]) -> str:
    """RESULTS.md."""
    m = res["machine"]
    lag, trl, eng = res["lag_sweep"], res["trl"], res["engine"]
    params = ", ".join(f"{k}: {v:,}" for k, v in eng["parameters"].items())
    load = ", ".join(f"{x:.1f}" for x in res["load_average_at_start"])
    return f"""# Benchmark results

Regenerate with `python tools/benchmarks/run_all.py` (after
`pip install torch==2.13.0 -e '.[bench]'`); what each benchmark measures is in
`benchmarks/README.md` and in the scripts' docstrings.

**Measured side by side.** Every ratio below compares configurations that ran interleaved
(alternating order) within this one invocation of `run_all.py`, started {res['started']} and
lasting {res['seconds'] / 60:.1f} min. Absolute times are for reference only: this machine may be
shared with other jobs (load average at the start: {load}). The *run-queue wait* columns say how
much they took: the share of wall time the benchmark's main thread was ready to run but waited
for a core (`/proc/thread-self/schedstat`); the *without run-queue wait* ratios subtract that
time, as an estimate for an otherwise idle machine.{separate(res)}

## Machine

| | |
|---|---|
| CPU (`/proc/cpuinfo`) | {m['cpu']} ({m['cpu_detail']}) |
| cores | {m['cores']} |
| memory | {m['memory']} |
| torch threads per benchmark process | {res['threads']} |
| Python | {m['python']} |
| torch | {m['torch']} |
| megatron-core | {m['megatron.core']} |
| transformers | {m['transformers']} |
| trl | {m['trl']} |
| platform | {m['platform']} |

## Targets (issue 7)

{chr(10).join(targets(res))}

## Targets (issue 17, measured by `hf_shapes.py` and `trl_side_by_side.py --hf-shape`)

Engine and whole-step targets are judged on CPU time of the working thread (every process runs
one torch thread): on a shared machine the wall clock ratios (given beside, with each process's
run-queue wait in the tables) also measure who got a core, not only the work each does. The lag
targets are wall-clock steps/s ratios of the sweep in section 1 (its rewards are timed sleeps).

{chr(10).join(hf_targets(res["hf_shapes"])) if "hf_shapes" in res else "not measured in this run"}
{chr(10).join(lag_targets(res["lag_sweep"]))}
{chr(10).join(trl_hf_targets(res["trl_hf"])) if "trl_hf" in res else ""}

## 1. Lag sweep

`pretrain_grpo.py` with the trainer's default model (2 layers, hidden 64, 4 heads) and batch
(8 prompts x 8 samples) on `tools.benchmarks.envs:LongTailLatencyEnvironment`: per-rollout token
budgets from a Pareto distribution (min 4, shape 1.2, cap 192: median ~7 tokens, a few rollouts
per batch run to 192) and a log-uniform 20-200 ms `asyncio.sleep` reward per rollout. The reward
(fraction of the budget used) saturates within the skipped steps, so every L generates nearly
the same tokens (column *gen tok/step*). Interleaved rounds: {lag['rounds']}, of
{lag['steps']} steps per L; the first {lag['skip']} steps of each run (start-up, pipeline fill,
learning) are not measured.
Flags besides `--rl-forced-lag L`: `{' '.join(lag['flags'])}`.

{lag_sweep.markdown(lag)}

The deterministic rows run with a reward-wait budget (`--rl-reward-wait-steps`, in the flags
above): once the awaited batch has finished generating, the window steps later batches for that
many more engine steps and the trainer takes the batch only after them, so the wait for its last
rewards is filled with generation while every token's policy version stays independent of timing.
*L=2, throughput* runs the same workload with `--no-rl-deterministic-schedule`: the engine steps
every batch in flight whenever a generation window is open (no window target, no wait for
announced requests), so the policy version of a token depends on reward timing. The gap to *L=2*
is what determinism still costs here. *L=2, reward wait 0* is the deterministic schedule without
a budget (the trainer's default, `--rl-reward-wait-steps 0`): the window idles while the awaited
batch's rewards are computed. The L=0 row is the same under either schedule (one batch
in flight).

*Mean active requests*: requests decoded per engine step, counted in-process by wrapping
`StepGroup.step` (all active requests step together in a generation window); *engine steps per
step*: engine forward steps per training step, in parentheses the share of them that also
prefill a newly admitted prompt. *Time in engine / waiting / training*: shares of wall time spent
in engine steps, in the generation window with no engine step running (rewards being awaited,
asyncio overhead), and in the training step.

## 2. Engine throughput

{eng['new_tokens']} new tokens per request (EOS disabled), {eng['prompt_length']}-token prompts,
sampling at temperature 1; the megatron-core model and the Hugging Face GPT-2 have the same shape
and parameter count ({params}); median of {eng['repeats']} interleaved repeats, in one process.

{engine_throughput.markdown(eng)}

## 3. TRL GRPOTrainer side by side

Same model shape (random init), digit-copy prompts and reward, 8 prompts x 8 samples, at most 16
new tokens, temperature 1, micro-batches of 32, lr 3e-3 constant, clip 0.2/0.28, no KL term;
{trl['steps']} steps per run of which the first {trl['skip']} are not measured;
interleaved rounds: {trl['rounds']}. Our flags besides `--rl-forced-lag` and
`--inference-max-requests`: `{' '.join(trl['flags'])}`.

{trl_side_by_side.markdown(trl)}

The trainers' policies learn at different speeds, and EOS ends a completion early on both
sides, so the mean tokens per completion (last column) differ; fewer tokens per step means less
work per step.

{hf_section(res["hf_shapes"]) if "hf_shapes" in res else ""}
{trl_hf_section(res["trl_hf"]) if "trl_hf" in res else ""}
## Reading the results

{chr(10).join(notes(res))}

![benchmarks](benchmarks.png)
"""


def trl_hf_section(trl_hf: dict[str, Any]) -> str:
    """Section 5 of RESULTS.md: whole GRPO step vs TRL on the HF checkpoints, with memory."""
    parts = []
    for shape, res in trl_hf.items():
        load = ", ".join(f"{x:.1f}" for x in res["load"])
        parts.append(
            f"**Llama {shape.upper()}** (the checkpoint of section 4), measured {res['started']} "
            f"(load average {load}); {res['steps']} steps per run of which the first "
            f"{res['skip']} are not measured, interleaved rounds: {res['rounds']}.\n\n"
            + trl_side_by_side.markdown(res)
        )
    body = "\n\n".join(parts)
    return f"""## 5. Whole GRPO step vs TRL on the Llama checkpoints, peak memory

Both trainers load the same random Llama checkpoint and its tokenizer (TRL with
`from_pretrained`, ours with `--hf-checkpoint`), on the digit-copy prompts and reward, 8
prompts x 8 samples, at most 16 new tokens (EOS may end a completion earlier on either side),
temperature 1, micro-batches of 32, lr 3e-3 constant, clip 0.2/0.28, no KL term; ours with
`--inference-max-requests 192`. *Generated tokens/step*: mean completion length x 64, the work
of each step's generation; the targets also give the ratio per generated token. *Peak RSS*: the
process's `ru_maxrss` (ours: the training process under `torchrun`), the largest over rounds.
Absolute times are not comparable with section 3 (other shape, other time of the day).

{body}
"""


def separate(res: dict[str, Any]) -> str:
    """A note when section 4 was measured by a later ``--only hf_shapes`` run."""
    hfs = res.get("hf_shapes")
    if not hfs or hfs["started"] == res["started"]:
        return ""
    return (
        f"\n\nSections 4 and 5 (and the issue-17 targets) were measured by a later "
        f"`run_all.py --only hf_shapes trl_hf` run, started {hfs['started']}, with the code of "
        "that date; their ratios are side by side within that run. Sections 1-3 keep the "
        "earlier run's numbers."
    )


def hf_section(hfs: dict[str, Any]) -> str:
    """Section 4 of RESULTS.md: engine and matmul efficiency on Llama HF checkpoints."""
    shapes = ", ".join(
        f"{s['shape']}: {s['architecture']['num_layers']} layers, hidden "
        f"{s['architecture']['hidden_size']}, {s['architecture']['num_attention_heads']} heads, "
        f"MLP {s['architecture']['intermediate_size']}, {s['architecture']['vocab_rows']} "
        f"vocabulary rows, {s['parameters']['ours']:,} parameters (HF: {s['parameters']['HF']:,})"
        for s in hfs["shapes"]
    )
    load = ", ".join(f"{x:.1f}" for x in hfs["load_average_at_start"])
    m = next((s["matmul"] for s in hfs["shapes"] if "matmul" in s), None)
    train = ""
    if m:
        b, t = m["train_micro_batch"]
        train = (
            f" The training step is one optimizer update of the trainer's model on {b} x {t} "
            "tokens: forward, token log-probabilities, a policy-gradient loss with per-sequence "
            "advantages, backward and Adam (the work of the trainer's micro-batch step, without "
            "its data pipeline)."
        )
    return f"""## 4. Llama-style Hugging Face checkpoints: engine vs HF `generate`, matmul efficiency

Measured {hfs['started']} (load average at its start: {load}), in one process, one torch
thread. Random Llama checkpoints (RMSNorm, RoPE, SwiGLU, untied output, 300-token BPE tokenizer)
written by `megatron.rl.models.hf.tiny.make_tiny_checkpoint` ({shapes}); ours is built from
`--hf-checkpoint DIR` exactly as `pretrain_grpo.py` does, HF's `LlamaForCausalLM` is
`from_pretrained(DIR)`. {hfs['batch']} arithmetic prompts of 4-8 tokens, {hfs['new_tokens']} new
tokens each (EOS disabled), temperature 1, no top-k/top-p, padded vocabulary rows never sampled;
median of {hfs['repeats']} interleaved repeats (rotating order); each ratio is the median of the
per-repeat ratios, in parentheses their range. *In CPU time*: the same ratio of tokens per CPU
second of the main thread (one torch thread, so it does all the work), the measure least moved
by other jobs on the cores.

{hf_shapes.markdown(hfs)}

Matmul efficiency: *measured torch.mm rate* is `torch.mm` on the model's own GEMMs (every
linear weight and the output layer against {hfs['batch']} rows for decode; for training the
forward and both backward GEMMs against the micro-batch's tokens), timed in the same process
right before; *achieved* counts 2 x (matmul weights) FLOPs per token (x3 with backward) over the
measured tokens/s or step time.{train}
"""


def notes(res: dict[str, Any]) -> list[str]:
    """Observations computed from the numbers (each a markdown bullet)."""
    out = []
    lag = {r["name"]: r for r in res["lag_sweep"]["results"]}
    if "L=0" in lag and "L=2" in lag:
        l0, l2 = lag["L=0"], lag["L=2"]
        out.append(
            f"- Lag pays off through batching the long tail: per training step the engine runs "
            f"{l0['engine_steps_per_step']:.0f} forward steps at L=0 with "
            f"{l0['mean_active_requests']:.1f} requests each, and "
            f"{l2['engine_steps_per_step']:.0f} steps with {l2['mean_active_requests']:.1f} "
            f"requests at L=2, for nearly the same tokens."
        )
        s0, s2 = l0["seconds_per_step"], l2["seconds_per_step"]
        packing = (
            "sequence packing trains only the real tokens"
            if "--rl-use-sequence-packing" in res["lag_sweep"]["flags"]
            else "micro-batches are padded to their longest rollout, up to ~200 tokens here"
        )
        out.append(
            f"- What lag does not hide at L=2: training is {l2['train_fraction']:.0%} of the step "
            f"({l2['train_fraction'] * s2:.3f} s vs {l0['train_fraction'] * s0:.3f} s at L=0: the "
            f"same work whatever L; {packing}), and {l2['waiting_fraction']:.0%} is spent in the "
            f"generation window with the engine idle ({l2['waiting_fraction'] * s2:.3f} s), "
            f"mostly the awaited batch's last 20-200 ms rewards."
        )
    if "L=2, throughput" in lag and "L=2" in lag:
        u, k = lag["L=2, throughput"], lag["L=2"]
        cost = k["seconds_per_step"] / u["seconds_per_step"]
        out.append(
            f"- The deterministic schedule costs {cost:.2f}x in step time at L=2: the throughput "
            f"schedule keeps later batches generating while the awaited batch's rewards are "
            f"pending (idle share {u['waiting_fraction']:.0%} instead of "
            f"{k['waiting_fraction']:.0%}), reaching {u['steps_per_s_ratio']:.2f}x L=0."
        )
    eng = {r["name"]: r for r in res["engine"]["results"]}
    b = res["engine"]["batch"]
    hf, serial = eng.get(f"HF generate, batch {b}"), eng.get("engine, one at a time")
    if hf and serial:
        out.append(
            f"- Batching is the engine's lever ({serial['engine_b64_over_this']:.0f}x over one "
            f"request at a time), but at batch {b} HF `generate` on the same-size GPT-2 is "
            f"{1 / hf['engine_b64_over_this']:.2f}x the engine's tokens/s."
        )
    for shape in res.get("hf_shapes", {}).get("shapes", []):
        prof = shape.get("profiles")
        if not prof:
            continue
        d = prof["decode"]
        top = {t["op"]: t["share"] for t in d["top"]}
        mm = top.get("aten::mm", 0.0)
        attn = top.get("aten::baddbmm", 0.0) + top.get("aten::bmm", 0.0)
        outside = max(0.0, 1 - d["operators_ms"] / d["wall_ms"])
        hf_row = next(r for r in shape["results"] if r["name"].startswith("HF generate"))
        hf_ratio = hf_row["cpu_engine_batch_over_this"]
        out.append(
            f"- Where a decode step's time goes, Llama {shape['shape'].upper()}: matmuls "
            f"{mm:.0%} and attention's batched matmuls {attn:.0%} of the operator time, "
            f"{outside:.0%} of the step outside operators (Python and dispatch); the rest is "
            "small elementwise operators (RoPE, RMSNorm, SwiGLU, the KV-cache writes, sampling). "
            "HF `generate` runs the same GEMMs on the same weights (stored (out, in), the layout "
            "this CPU multiplies at ~75% of the speed of the engine's transposed copies) and SDPA; "
            f"in CPU time the engine runs at {hf_ratio:.2f}x HF `generate` here."
        )
    trl = {r["name"]: r for r in res["trl"]["results"]}
    if "ours L=0" in trl and "ours L=2, 64 slots" in trl:
        out.append(
            f"- Against TRL, ours at L=0 runs at {trl['ours L=0']['speedup_vs_trl']:.2f}x TRL's "
            f"speed; L=2 needs KV-cache slots for all 3 batches in flight "
            f"(`--inference-max-requests 192`): with the default 64 it reaches "
            f"{trl['ours L=2, 64 slots']['speedup_vs_trl']:.2f}x."
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="Torch threads per process.")
    parser.add_argument("--rounds", type=int, default=2, help="Interleaved rounds (sweep, TRL).")
    parser.add_argument("--engine-repeats", type=int, default=7)
    parser.add_argument("--hf-repeats", type=int, default=5, help="Repeats of hf_shapes.py.")
    parser.add_argument(
        "--trl-hf",
        nargs="+",
        default=["1m:2:24:8", "25m:1:12:4"],
        help="TRL side by side on HF checkpoints: SHAPE:ROUNDS:STEPS:SKIP for each shape.",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=BENCHMARKS,
        default=None,
        help="Measure only these benchmarks and merge them into the results.json in --out (the "
        "others keep their earlier numbers and dates).",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="Results directory.")
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="Rewrite RESULTS.md and the plot from the results.json in --out; measure nothing.",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="Smoke test: few steps, one round (numbers not meaningful; use with --out).",
    )
    opts = parser.parse_args()
    if opts.render_only:
        res = json.loads((opts.out / "results.json").read_text())
        write_results(res, opts.out)
        return

    common = ["--rounds", str(opts.rounds), "--threads", str(opts.threads)]
    if opts.quick:
        common = ["--rounds", "1", "--threads", str(opts.threads), "--steps", "12", "--skip", "6"]
        opts.engine_repeats = opts.hf_repeats = 2
    lag_sweep.add_arguments(p := argparse.ArgumentParser())
    sweep_opts = p.parse_args([*common, "--compare-reward-wait-steps", "0"])  # + a no-budget row
    trl_side_by_side.add_arguments(p := argparse.ArgumentParser())
    trl_opts = p.parse_args(common)

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    started = time.time()
    only = set(opts.only or BENCHMARKS)
    res: dict[str, Any] = {
        "started": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "machine": machine(),
        "threads": opts.threads,
        "load_average_at_start": os.getloadavg(),
    }
    if opts.only:  # keep the other benchmarks' numbers (and their run's date) from --out
        res = {**json.loads((opts.out / "results.json").read_text()), "machine": res["machine"]}
    with tempfile.TemporaryDirectory() as tmp:
        if "engine" in only:
            print("engine throughput ...", flush=True)
            res["engine"] = run_engine(opts, Path(tmp))
            print(engine_throughput.markdown(res["engine"]), flush=True)
        if "trl" in only:
            print("TRL side by side ...", flush=True)
            res["trl"] = trl_side_by_side.run(trl_opts, Path(tmp) / "trl")
            print(trl_side_by_side.markdown(res["trl"]), flush=True)
        if "lag_sweep" in only:
            print("lag sweep ...", flush=True)
            res["lag_sweep"] = lag_sweep.run(sweep_opts, Path(tmp) / "lag")
            print(lag_sweep.markdown(res["lag_sweep"]), flush=True)
        if "trl_hf" in only:
            res["trl_hf"] = {}
            for spec in opts.trl_hf:
                shape, rounds, steps, skip = spec.split(":")
                if opts.quick:
                    rounds, steps, skip = "1", "5", "2"
                trl_side_by_side.add_arguments(p := argparse.ArgumentParser())
                flags = ["--hf-shape", shape, "--rounds", rounds, "--steps", steps, "--skip", skip]
                shape_opts = p.parse_args([*flags, "--threads", str(opts.threads)])
                print(f"TRL side by side on the Llama {shape} checkpoint ...", flush=True)
                when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
                out = trl_side_by_side.run(shape_opts, Path(tmp) / f"trl_{shape}")
                res["trl_hf"][shape] = {**out, "started": when, "load": os.getloadavg()}
                print(trl_side_by_side.markdown(out), flush=True)
        if "hf_shapes" in only:
            print("Llama HF checkpoints: engine vs HF generate, matmul efficiency ...", flush=True)
            res["hf_shapes"] = run_hf_shapes(opts, Path(tmp))
            print(hf_shapes.markdown(res["hf_shapes"]), flush=True)
    if not opts.only:
        res["seconds"] = time.time() - started
        res["load_average_at_end"] = os.getloadavg()

    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    write_results(res, opts.out)


def write_results(res: dict[str, Any], out: Path) -> None:
    """RESULTS.md and benchmarks.png from the measured ``res``."""
    plot(res, out / "benchmarks.png")
    (out / "RESULTS.md").write_text(report(res))
    extra = (hf_targets(res["hf_shapes"]) if "hf_shapes" in res else []) + (
        trl_hf_targets(res["trl_hf"]) if "trl_hf" in res else []
    )
    print("\n".join(targets(res) + extra))
    print(f"wrote {out}/RESULTS.md, benchmarks.png ({res['seconds']:.0f} s of measurements)")


if __name__ == "__main__":
    main()
