"""A step-time model of collocated (synchronous) vs non-collocated generation, from measured
phase costs; checked against this machine's two-process runs, then used to predict.

    python tools/benchmarks/refit_model.py [--measured benchmarks/results/refit.json]

Per step, with N devices:

* collocated: every device generates, then every device trains:
  ``t_c = W_g / (u * N) + W_t / N``, where ``W_g`` and ``W_t`` are the device-seconds of
  generation and training at full use and ``u`` is the share of the generation phase the
  devices are busy (a synchronous window waits for its longest rollout: the tail);
* non-collocated: ``N_i`` devices generate while ``N - N_i`` train, the slower side sets the
  pace, and the refit (``R`` seconds, at the start of each step on both sides) adds to it:
  ``t_nc = max(W_g / N_i, W_t / (N - N_i)) + R``, at the best integer ``N_i``. Generation there
  keeps its slots full across step boundaries (continuous batching with lag >= 1), so its ``u``
  is taken as 1.

The check: ``W_g``, ``W_t``, ``u`` and ``R`` measured in ``refit.json`` (two CPU processes: the
``dp2`` layout's engine and update seconds, doubled; the non-collocated layout's full refit)
give a predicted non-collocated s/step at N = 2, N_i = 1, printed beside the measured one.

The prediction: the speed-up ``t_c / t_nc`` over a grid of generation shares of the synchronous
step ``g = W_g / (u t_c N)``, tail utilizations ``u`` and refit shares ``R / t_c``. These are
the model's inputs, not measurements of other systems: the peers' published speed-ups (1.7-2.8x)
are the model's output only where generation is most of the step and its tail leaves the devices
idle for half of it or more. Writes ``refit_model.json`` and ``refit_model.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARES = (0.5, 0.7, 0.8)
UTILIZATIONS = (1.0, 0.6, 0.4)
REFIT_SHARES = (0.0, 0.02, 0.05)


def collocated(w_g: float, w_t: float, u: float, n: int) -> float:
    """Seconds per step when every device generates, then trains."""
    return w_g / (u * n) + w_t / n


def non_collocated(w_g: float, w_t: float, refit: float, n: int) -> tuple[float, int]:
    """Seconds per step at the best split of ``n`` devices, and that split's inference count."""
    return min((max(w_g / i, w_t / (n - i)) + refit, i) for i in range(1, n))


def speedup(g: float, u: float, refit_share: float, n: int = 64) -> float:
    """``t_c / t_nc`` for a synchronous step that is ``g`` generation (of which the devices are
    busy ``u``) and whose refit costs ``refit_share`` of it, on ``n`` devices."""
    t_c = 1.0  # one synchronous step, the unit
    w_g, w_t = g * u * n, (1 - g) * n  # device-seconds at full use
    return t_c / non_collocated(w_g, w_t, refit_share * t_c, n)[0]


def check(measured: dict) -> list[dict]:
    """Per forced lag: the model's non-collocated s/step from the dp2 phases, and the measured."""
    rows = {(r["lag"], r["layout"]): r["summary"] for r in measured["rows"]}
    out = []
    for lag in sorted({lag for lag, _ in rows}):
        dp2, nc = rows.get((lag, "dp2")), rows.get((lag, "nc-tp1+tp1"))
        if dp2 is None or nc is None:
            continue
        w_g, w_t = 2 * dp2["engine_seconds"], 2 * dp2["train_seconds"]
        u = dp2["engine_seconds"] / max(dp2["collect_seconds"], 1e-9)
        predicted, _ = non_collocated(w_g, w_t, nc["refit/seconds"], 2)
        window = nc["inference/window_seconds"]  # its sides' own phases, measured
        own = max(nc["train_seconds"], window) + nc["refit/seconds"]
        out.append(
            {
                "lag": lag,
                "collocated_measured": dp2["step_seconds"],
                "collocated_model": collocated(w_g, w_t, u, 2),
                "non_collocated_measured": nc["step_seconds"],
                "non_collocated_model": predicted,
                "non_collocated_model_own_phases": own,
                "u": u,
            }
        )
    return out


def markdown(result: dict) -> str:
    lines = [
        "# Step-time model: collocated vs non-collocated generation",
        "",
        "From `python tools/benchmarks/refit_model.py` (the model is in its docstring) on "
        f"`{result['measured']}` ({result['machine']}).",
        "",
        "## Check against the two-process CPU runs",
        "",
        "Model columns: from the dp2 run's phases, scaled as the model scales them (ideal: half "
        "the devices, twice the time), and from the non-collocated run's own phases (its update "
        "and its inference window, the slower of the two, plus the refit).",
        "",
        "| L | dp2 s/step measured / model | non-collocated 1+1 s/step measured / model from dp2 "
        "/ model from its own phases | u |",
        "| --- | --- | --- | --- |",
    ]
    for r in result["check"]:
        lines.append(
            f"| {r['lag']} | {r['collocated_measured']:.2f} / {r['collocated_model']:.2f} | "
            f"{r['non_collocated_measured']:.2f} / {r['non_collocated_model']:.2f} / "
            f"{r['non_collocated_model_own_phases']:.2f} | {r['u']:.2f} |"
        )
    lines += [
        "",
        "## Predicted speed-up of non-collocated generation, 64 devices (a prediction)",
        "",
        "g: generation's share of the synchronous step; u: the share of that phase the devices "
        "are busy (the tail); refit: its cost as a share of the synchronous step.",
        "",
        "| g | u | " + " | ".join(f"refit {r:.0%}" for r in REFIT_SHARES) + " |",
        "| --- | --- | " + " | ".join("---" for _ in REFIT_SHARES) + " |",
    ]
    for row in result["prediction"]:
        cells = " | ".join(f"{s:.2f}x" for s in row["speedup"])
        lines.append(f"| {row['g']:.1f} | {row['u']:.1f} | {cells} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--measured", type=Path, default=REPO / "benchmarks" / "results" / "refit.json"
    )
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    opts = parser.parse_args()
    measured = json.loads(opts.measured.read_text())
    m = measured["machine"]
    result = {
        "measured": str(opts.measured.relative_to(REPO) if opts.measured.is_absolute() else ""),
        "machine": f"{m['cpu']}, {m['cores']} cores, measured {measured['date']}",
        "check": check(measured),
        "prediction": [
            {"g": g, "u": u, "speedup": [speedup(g, u, r) for r in REFIT_SHARES]}
            for g in SHARES
            for u in UTILIZATIONS
        ],
    }
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "refit_model.json").write_text(json.dumps(result, indent=1) + "\n")
    (opts.out / "refit_model.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
