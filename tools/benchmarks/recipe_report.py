"""``recipe.py``'s outputs from its json alone: ``recipe.md`` (``markdown``: each run's first
and last evaluation, wall time and whether it learned beyond the start's noise) and ``recipe.png``
(``plot``: held-out greedy accuracy and batch reward against training wall-clock)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any


def significant(evals: list[dict[str, Any]]) -> bool:
    """Whether the last evaluation's 95% interval lies entirely above the first's (the strict
    reading: both estimates' noise counted)."""
    return evals[-1]["greedy_ci95"][0] > evals[0]["greedy_ci95"][1]


def above_start_interval(evals: list[dict[str, Any]]) -> bool:
    """Whether the last greedy accuracy lies above the first evaluation's 95% interval (not within
    the start's noise)."""
    return evals[-1]["greedy_accuracy"] > evals[0]["greedy_ci95"][1]


def markdown(res: dict[str, Any]) -> str:
    """The recipe's table: each run's first and last evaluation, its wall time, significance."""
    k = res["eval_samples"]
    lines = [
        "| run | steps | training wall time | greedy accuracy, start (95% CI) | last (95% CI) |"
        " last above the start's interval / intervals disjoint | pass@1 start -> last |"
        f" pass@{k} start -> last | greedy truncated start -> last |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in res["runs"].items():
        first, last = run["evals"][0], run["evals"][-1]
        ci = lambda e: f"{e['greedy_ci95'][0]:.1%}-{e['greedy_ci95'][1]:.1%}"  # noqa: E731
        noted = "*" if "note" in run else ""
        lines.append(
            f"| {name} | {last['step']} | {last['seconds'] / 60:.1f} min{noted} | "
            f"{first['greedy_accuracy']:.1%} ({ci(first)}) | "
            f"{last['greedy_accuracy']:.1%} ({ci(last)}) | "
            f"{'yes' if above_start_interval(run['evals']) else 'no'} / "
            f"{'yes' if significant(run['evals']) else 'no'} | "
            f"{first['pass@1']:.1%} -> {last['pass@1']:.1%} | "
            f"{first[f'pass@{k}']:.1%} -> {last[f'pass@{k}']:.1%} | "
            f"{first['greedy_truncated_fraction']:.0%} -> {last['greedy_truncated_fraction']:.0%} |"
        )
    notes = [f"\n\\* {name}: {run['note']}" for name, run in res["runs"].items() if "note" in run]
    return "\n".join(lines + notes)


def configuration(name: str) -> str:
    """A run's configuration: its name without the ``seed S`` suffix of another seed's run."""
    head, _, tail = name.rpartition(" seed ")
    return head if head and tail.isdigit() else name


def seeds_markdown(res: dict[str, Any], reference: str = "ours L=0") -> str:
    """Per configuration, the last evaluation's greedy accuracy over its seeds (mean, spread,
    each seed's), with the pooled 95% interval of ``reference``'s seeds (all its problems of
    all its seeds counted as one sample), whether the configuration's mean lies inside it, and a
    LoRA run's export evaluated through ``evaluate`` (mean over seeds)."""
    from megatron.rl.eval.confidence import wilson_interval

    groups: dict[str, list[dict[str, Any]]] = {}
    for name, run in res["runs"].items():
        if "evals" in run:
            groups.setdefault(configuration(name), []).append(run)
    if not any(len(runs) > 1 for runs in groups.values()):
        return ""
    ref = groups.get(reference, [])
    correct = sum(round(r["evals"][-1]["greedy_accuracy"] * r["evals"][-1]["prompts"]) for r in ref)
    total = sum(r["evals"][-1]["prompts"] for r in ref)
    low, high = wilson_interval(correct, total) if total else (0.0, 1.0)
    lines = [
        f"Step-{ref[0]['evals'][-1]['step'] if ref else '?'} held-out greedy accuracy over seeds; "
        f"{reference}'s seeds pooled: {correct / max(total, 1):.1%} ({low:.1%}-{high:.1%}).",
        "",
        "| configuration | seeds | mean | spread (min-max) | each seed | mean inside the reference's"
        " interval | export through evaluate (mean) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in groups.items():
        accs = [r["evals"][-1]["greedy_accuracy"] for r in runs]
        mean = statistics.fmean(accs)
        exports = [r["export_eval"]["greedy_accuracy"] for r in runs if "export_eval" in r]
        lines.append(
            f"| {name} | {len(runs)} | {mean:.1%} | {min(accs):.1%}-{max(accs):.1%} | "
            f"{', '.join(f'{a:.1%}' for a in accs)} | {'yes' if low <= mean <= high else 'no'} | "
            f"{f'{statistics.fmean(exports):.1%}' if exports else 'n/a'} |"
        )
    return "\n".join(lines)


def plot(res: dict[str, Any], path: Path) -> None:
    """Greedy held-out accuracy (with its interval) and batch reward against wall-clock time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, rew) = plt.subplots(1, 2, figsize=(12, 4.2))
    for name, run in res["runs"].items():
        minutes = [e["seconds"] / 60 for e in run["evals"]]
        values = [e["greedy_accuracy"] for e in run["evals"]]
        low = [e["greedy_accuracy"] - e["greedy_ci95"][0] for e in run["evals"]]
        high = [e["greedy_ci95"][1] - e["greedy_accuracy"] for e in run["evals"]]
        acc.errorbar(minutes, values, yerr=[low, high], marker="o", capsize=3, label=name)
        rewards = [s["reward"] for s in run["steps"]]
        smooth = [statistics.fmean(rewards[max(0, i - 4) : i + 1]) for i in range(len(rewards))]
        rew.plot([s["seconds"] / 60 for s in run["steps"]], smooth, label=name)
    acc.set_title(f"held-out greedy accuracy ({res['eval_prompts']} problems, 95% CI)")
    rew.set_title("training reward (batch mean, last 5 steps)")
    for ax in (acc, rew):
        ax.set_xlabel("training wall-clock (minutes, 2 CPU cores)")
        ax.legend()
    fig.suptitle("SmolLM2-135M-Instruct, GRPO on arithmetic word problems")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
