"""``gpu.md`` and ``gpu.json`` from the output directory of ``tools/device_check.sh``.

    python tools/device_report.py OUT [--dry-run]

Reads ``parts.jsonl`` (each part's status, cap and seconds), the ``tools/bench_cuda.py`` JSON at
the end of each ``b_*.log``, the pytest summary line of ``a_gpu_tests.log``, the per-step
records of ``c_grpo_lag*.jsonl`` and the ``tools/refit_bandwidth.py`` JSON of ``d_*.log``; writes the card, the date, the versions, every number and its
ratio to the device's limits (MFU against the dense bf16 peak, decode bandwidth against the HBM
bandwidth). A part that failed or ran past its cap is reported as such, with its log's tail.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

PHASES = ("collect_seconds", "train_seconds")


def last_json(text: str) -> dict | None:
    """The last top-level JSON object printed in ``text`` (bench_cuda's result)."""
    end = text.rfind("}")
    start = text.rfind("\n{", 0, end)
    start = 0 if start < 0 and text.startswith("{") else start
    if end < 0 or start < 0:
        return None
    try:
        return json.loads(text[start : end + 1])
    except json.JSONDecodeError:
        return None


def grpo_summary(path: Path) -> dict[str, Any] | None:
    """Median whole-step seconds after the first step, and each phase's share of the step."""
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = records[1:] or records
    if not kept:
        return None
    step = statistics.median(r["step_seconds"] for r in kept)
    out: dict[str, Any] = {"steps": len(records), "step_seconds": step}
    for phase in PHASES:
        out[f"{phase}_share"] = statistics.median(r[phase] / r["step_seconds"] for r in kept)
    out["generated_tokens_per_s"] = statistics.median(r["generated_tokens_per_s"] for r in kept)
    return out


def versions() -> dict[str, str]:
    """Python, torch (and its CUDA) and megatron-core."""
    found = {"python": platform.python_version()}
    try:
        import torch

        found["torch"] = torch.__version__
        found["cuda"] = str(torch.version.cuda)
    except ImportError:
        pass
    try:
        import megatron.core

        found["megatron.core"] = megatron.core.__version__
    except (ImportError, AttributeError):
        pass
    return found


def collect(out: Path) -> dict[str, Any]:
    """Every part's status and numbers."""
    parts = [json.loads(line) for line in (out / "parts.jsonl").read_text().splitlines()]
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "versions": versions()}
    result["parts"] = []
    for part in parts:
        log = (out / f"{part['part']}.log").read_text(errors="replace")
        entry = dict(part, ok=part["rc"] == 0, timed_out=part["rc"] == 124)
        if part["part"].startswith("b_"):
            entry["bench"] = last_json(log)
        elif part["part"].startswith("a_"):
            lines = [ln for ln in log.splitlines() if re.search(r"passed|failed|collected", ln)]
            entry["summary"] = lines[-1].strip("= ") if lines else None
        elif part["part"].startswith("c_"):
            entry["grpo"] = grpo_summary(out / f"{part['part']}.jsonl")
        elif part["part"].startswith("d_"):
            entry["refit"] = last_json(log)
        if not entry["ok"]:
            entry["log_tail"] = log[-1500:]
        result["parts"].append(entry)
    benches = [p["bench"] for p in result["parts"] if p.get("bench")]
    result["device"] = benches[0]["device"] if benches else "unknown"
    lags = {p["part"]: p.get("grpo") for p in result["parts"] if p["part"].startswith("c_")}
    if lags.get("c_grpo_lag0") and lags.get("c_grpo_lag2"):
        a, b = lags["c_grpo_lag0"]["step_seconds"], lags["c_grpo_lag2"]["step_seconds"]
        result["lag2_speedup"] = a / b
    refit = next((p["refit"] for p in result["parts"] if p.get("refit")), None)
    if refit and lags.get("c_grpo_lag0"):  # the refit column of refit_model.md, measured
        step = lags["c_grpo_lag0"]["step_seconds"]
        result["refit_share_of_step"] = {
            "non_collocated": refit["non_collocated_refit_seconds"] / step,
            "collocated_same_layout": refit["paths"]["device_copy"]["seconds"] / step,
        }
    return result


def pct(value: float | None) -> str:
    """A ratio as a percentage, or n/a (an unknown device limit)."""
    return "n/a" if value is None else f"{value:.1%}"


def markdown(result: dict[str, Any], dry_run: bool) -> str:
    """The report's table."""
    v = result["versions"]
    lines = [
        "# GPU check" + (" (CPU dry run: the numbers mean nothing)" if dry_run else ""),
        "",
        f"{result['device']}, {result['date']}; Python {v.get('python')}, torch "
        f"{v.get('torch')} (CUDA {v.get('cuda')}), megatron-core {v.get('megatron.core')}. "
        "Written by `tools/device_check.sh` (`tools/device_report.py`).",
        "",
        "| part | status | seconds (cap) | result |",
        "| --- | --- | --- | --- |",
    ]
    for p in result["parts"]:
        status = "ok" if p["ok"] else ("past its cap" if p["timed_out"] else f"failed ({p['rc']})")
        lines.append(f"| {p['part']} | {status} | {p['seconds']} ({p['cap']}) | {describe(p)} |")
    if "lag2_speedup" in result:
        lines += ["", f"L=2 takes {1 / result['lag2_speedup']:.2f}x the step time of L=0."]
    if "refit_share_of_step" in result:
        share = result["refit_share_of_step"]
        lines += [
            "",
            f"A refit of these weights costs {share['non_collocated']:.1%} of the L=0 step "
            f"through the host (non-collocated) and {share['collocated_same_layout']:.2%} as a "
            "device copy (collocated, same layout): the refit share of "
            "[refit_model.md](refit_model.md)'s prediction.",
        ]
    failed = [p for p in result["parts"] if not p["ok"]]
    for p in failed:
        lines += ["", f"## {p['part']}: log tail", "", "```", p["log_tail"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def describe(part: dict[str, Any]) -> str:
    """One cell: a part's numbers and their ratios to the limits."""
    if part.get("summary"):
        return part["summary"]
    bench = part.get("bench")
    if bench:
        cells = [f"{bench['parameters'] / 1e6:.0f}M parameters, {bench.get('engine', '')}"]
        if "train_tokens_per_s" in bench:
            cells.append(
                f"training {bench['train_tokens_per_s']:,.0f} tok/s, "
                f"{bench['train_model_tflops_per_s']:.1f} TFLOP/s, MFU {pct(bench['mfu'])}"
            )
        cells.append(
            f"generation {bench['generated_tokens_per_s']:,.0f} tok/s, decode "
            f"{bench['decode_tbps']:.2f} TB/s = {pct(bench['decode_bandwidth_utilisation'])} "
            "of the memory bandwidth"
        )
        if bench.get("peak_memory_gib") is not None:
            cells.append(f"peak memory {bench['peak_memory_gib']:.1f} GiB")
        return "; ".join(cells)
    refit = part.get("refit")
    if refit:
        paths = ", ".join(
            f"{name} {p['gb_per_s']:.1f} GB/s ({p['seconds']:.3f} s)"
            for name, p in refit["paths"].items()
        )
        return (
            f"{refit['bytes'] / 1e9:.2f} GB of bf16 weights: {paths}; a non-collocated refit "
            f"through the host {refit['non_collocated_refit_seconds']:.2f} s"
        )
    grpo = part.get("grpo")
    if grpo:
        return (
            f"{grpo['step_seconds']:.2f} s/step, generation wait "
            f"{grpo['collect_seconds_share']:.0%}, update {grpo['train_seconds_share']:.0%}, "
            f"{grpo['generated_tokens_per_s']:,.0f} generated tok/s"
        )
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dry-run", action="store_true")
    opts = parser.parse_args(argv)
    result = collect(opts.out)
    result["dry_run"] = opts.dry_run
    (opts.out / "gpu.json").write_text(json.dumps(result, indent=1) + "\n")
    (opts.out / "gpu.md").write_text(markdown(result, opts.dry_run))
    print(markdown(result, opts.dry_run))
    return 0 if all(p["ok"] for p in result["parts"]) else 1


if __name__ == "__main__":
    sys.exit(main())
