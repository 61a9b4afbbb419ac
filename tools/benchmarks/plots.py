"""``benchmarks/results/benchmarks.png``: the benchmarks' ratios as bar charts, one panel each.

``plot`` draws the five panels (lag sweep, engine throughput, TRL side by side, engine on the HF
checkpoints, GRPO step vs TRL on them) from ``results.json``; absolute times stay in the tables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.benchmarks.targets import (
    HF_TARGET,
    LAG_TARGET,
    SERIAL_TARGET,
    TRL_L0_TARGET,
    TRL_L2_TARGET,
)


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
    """The five panels of ratios (lag sweep, engine throughput, TRL side by side, the two HF
    checkpoint panels when measured) as one PNG at ``path``."""
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
    groups = [
        (f"HF generate, batch {b}", f"÷ HF generate (target {HF_TARGET}x)"),
        ("engine, one at a time", f"÷ one at a time (target {SERIAL_TARGET}x)"),
    ]
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
