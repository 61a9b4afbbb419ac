"""Plot loss, reward and submission-staleness curves of GRPO runs to one PNG.

Inputs are ``--metrics-file`` JSONL files of ``pretrain_grpo.py`` runs or ``golden_values.json``
files of regression cases (``{metric: [value per step]}``), in any mix; each becomes one line per
panel, labelled with its path (or ``LABEL=PATH``).

    python tools/plot_curves.py run_a.jsonl run_b.jsonl -o curves.png
    python tools/plot_curves.py \\
        golden=tests/functional_tests/test_cases/lag2/golden_values.json actual=metrics.jsonl \\
        -o lag2.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PANELS = (
    ("loss", "loss"),
    ("reward_mean", "reward (mean)"),
    ("staleness_mean", "submission staleness (steps)"),
)


def load_curves(path: Path) -> dict[str, list[float]]:
    """``{metric: values per step}`` of a metrics JSONL file or a golden_values.json file."""
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
        if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
            raise ValueError(f"{path}: expected {{metric: [value per step]}}")
        return data
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {lineno}: not JSON ({err.msg})") from None
    records.sort(key=lambda r: r.get("step", 0))
    keys = {k for r in records for k in r}
    return {k: [r.get(k, float("nan")) for r in records] for k in keys}


def plot(runs: dict[str, dict[str, list[float]]], output: Path) -> None:
    """Draw one panel per metric of ``PANELS``, one line per run, and save a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    for ax, (metric, title) in zip(axes, PANELS):
        for label, curves in runs.items():
            values = curves.get(metric)
            if values:
                steps = curves.get("step") or list(range(len(values)))
                ax.plot(steps, values, label=label, linewidth=1.2)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="metrics .jsonl or golden_values.json [LABEL=]PATH")
    parser.add_argument("-o", "--output", type=Path, default=Path("curves.png"), help="PNG path")
    opts = parser.parse_args(argv)
    runs = {}
    for spec in opts.runs:
        label, _, path = spec.rpartition("=")
        path = Path(path)
        if not path.is_file():
            parser.error(f"no such file: {path}")
        try:
            runs[label or str(path)] = load_curves(path)
        except ValueError as err:
            parser.error(str(err))
    plot(runs, opts.output)
    print(f"wrote {opts.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
