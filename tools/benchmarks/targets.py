"""The benchmark targets and the RESULTS.md lines that judge them, met or not.

Each ``*_targets`` function turns one benchmark's results (as stored in ``results.json``) into
markdown bullets that name the target, say **met** or **not met**, and give the measured ratios;
the ``*_TARGET`` constants are the thresholds (also drawn as lines in ``plots.py``).
"""

from __future__ import annotations

from typing import Any

from tools.benchmarks.common import spread

LAG_TARGET = 2.0
"""Default model: L=2 must reach this many times the steps/s of L=0."""
HF_TARGET, SERIAL_TARGET = 1.3, 5.0
"""Llama checkpoints: engine tokens/s at batch 64 over HF ``generate`` / over one at a time."""
DETERMINISTIC_LAG_TARGET, THROUGHPUT_LAG_TARGET = 1.9, 2.3
"""Per lag schedule: L=2 steps/s over L=0 with the deterministic (reward-wait budget) and
throughput schedules."""
DECODE_MATMUL_TARGET, TRAIN_MATMUL_TARGET = 0.25, 0.50
"""Llama 25M: share of the measured matmul rate reached by decode / by a training step."""
TRL_L0_TARGET, TRL_L2_TARGET = 1.3, 2.0
"""Llama checkpoints: TRL s/step over ours at L=0 / at L=2 on the same HF checkpoint."""
REAL_RSS_TARGET_MIB, REAL_TRL_L0_TARGET = 3072, 1.3
"""SmolLM2-135M-Instruct at the recipe's shape: peak RSS (and <= TRL's at the same
precision); TRL s/step over ours at L=0 with equal work."""


def real_model_targets(rm: dict[str, Any]) -> list[str]:
    """The memory and whole-step targets on the real model, per configuration of ours."""
    rows = {r["name"]: r for r in rm["results"]}
    lines = []
    for r in rm["results"]:
        if r["lag"] is None:
            continue
        trl = rows["trl bf16" if r["bf16"] else "trl fp32"]
        rss = r["peak_rss_mib"]
        met = rss <= REAL_RSS_TARGET_MIB and rss <= trl["peak_rss_mib"]
        lines.append(
            f"- SmolLM2-135M, {r['name']}: peak RSS <= {REAL_RSS_TARGET_MIB} MiB and <= TRL's "
            f"({trl['name']}): **{'met' if met else 'not met'}**: {rss:.0f} MiB (generation "
            f"window {r['generation_peak_mib']:.0f}, training update "
            f"{r['training_peak_mib']:.0f}), TRL {trl['peak_rss_mib']:.0f} MiB."
        )
        if r["lag"] == 0:
            v = r["speedup_vs_trl"]
            lines.append(
                f"- SmolLM2-135M, {r['name']}: whole GRPO step >= {REAL_TRL_L0_TARGET}x TRL at "
                f"equal work: **{'met' if v >= REAL_TRL_L0_TARGET else 'not met'}**: TRL ÷ ours "
                f"= {v:.2f}x (wall clock, rounds {spread(r['speedup_vs_trl_per_round'])}; "
                f"{r['seconds_per_step']:.1f} vs {trl['seconds_per_step']:.1f} s/step)."
                + ceiling(r)
            )
    return lines


def hf_targets(hfs: dict[str, Any]) -> list[str]:
    """One line per engine and matmul target that ``hf_shapes.py`` measures, met or not."""
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


def ceiling(row: dict[str, Any]) -> str:
    """What the training step alone allows: TRL's s/step over ours without generation."""
    if "training_ceiling_vs_trl" not in row:
        return ""
    return (
        f" Ceiling with free generation: TRL ÷ our training step alone "
        f"({row['train_seconds_per_step']:.3f} s) = {row['training_ceiling_vs_trl']:.2f}x."
    )


def trl_hf_targets(trl_hf: dict[str, Any]) -> list[str]:
    """The whole-step and memory targets against TRL on each HF checkpoint."""
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
                f"{per_token:.2f}x per generated token in CPU time)." + ceiling(r)
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
    """The lag-schedule targets: L=2 over L=0 under either schedule."""
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
    """One line per default-model target (L=2 over L=0 steps/s, ours faster than TRL at L=2), met
    or not, with the measured ratios."""
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
