"""Regenerates every benchmark result: engine throughput, TRL side by side, lag sweep, and the
engine and matmul efficiency on Llama-style Hugging Face checkpoints.

    pip install torch==2.13.0 -e '.[bench]'
    python tools/benchmarks/run_all.py            # about 55 minutes on 2 CPU cores
    python tools/benchmarks/run_all.py --only hf_shapes   # re-measure one benchmark

Runs ``engine_throughput.py``, ``trl_side_by_side.py``, ``lag_sweep.py``, ``hf_shapes.py``,
``real_model.py`` and ``lora.py`` (see their docstrings for what each measures; ``lora.py`` also
writes ``lora.md``) one after another in this single invocation, then writes

* ``benchmarks/results/RESULTS.md``: the machine, the commands, one markdown table per benchmark
  and whether the targets were met;
* ``benchmarks/results/benchmarks.png``: the ratios as bar charts (absolute times are in the
  tables, never used as bars);
* ``benchmarks/results/results.json``: every number, for diffs between runs.

Every comparison inside a benchmark is measured side by side (interleaved runs in this one
invocation); ratios, not absolute times, are what the targets are checked against.

This module runs the benchmarks and writes the files (``main``, ``write_results``); the text of
RESULTS.md is ``report.py``, the target lines and thresholds ``targets.py``, the chart
``plots.py``: all three are pure functions of ``results.json`` (``--render-only`` redoes them).
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

from tools.benchmarks import (  # noqa: E402
    engine_throughput,
    hf_shapes,
    lag_sweep,
    real_model,
    trl_side_by_side,
)
from tools.benchmarks.common import REPO, machine, subprocess_env  # noqa: E402
from tools.benchmarks.plots import plot  # noqa: E402
from tools.benchmarks.report import report  # noqa: E402
from tools.benchmarks.targets import (  # noqa: E402
    hf_targets,
    real_model_targets,
    targets,
    trl_hf_targets,
)

RESULTS = REPO / "benchmarks" / "results"
BENCHMARKS = ("engine", "trl", "lag_sweep", "hf_shapes", "trl_hf", "real_model", "lora")


def run_engine(opts: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """``engine_throughput.py`` in its own process (it initializes torch.distributed)."""
    out = workdir / "engine.json"
    cmd = [
        sys.executable,
        str(REPO / "tools" / "benchmarks" / "engine_throughput.py"),
        "--json",
        str(out),
        "--threads",
        str(opts.threads),
        "--repeats",
        str(opts.engine_repeats),
    ]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env=subprocess_env(opts.threads),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"engine_throughput.py failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    return json.loads(out.read_text())


def run_hf_shapes(opts: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """``hf_shapes.py`` in its own process (it initializes torch.distributed)."""
    out = workdir / "hf_shapes.json"
    cmd = [
        sys.executable,
        str(REPO / "tools" / "benchmarks" / "hf_shapes.py"),
        "--json",
        str(out),
        "--threads",
        str(opts.threads),
        "--repeats",
        str(opts.hf_repeats),
    ]
    started = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    load = os.getloadavg()
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env=subprocess_env(opts.threads),
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"hf_shapes.py failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return {**json.loads(out.read_text()), "started": started, "load_average_at_start": load}


def run_lora(opts: argparse.Namespace) -> dict[str, Any]:
    """``lora.py`` in its own process (it initializes torch.distributed): LoRA against full
    fine-tuning and TRL + PEFT, the 1.7B shape, the engine; it writes ``lora.json`` and
    ``lora.md`` into ``--out`` itself."""
    steps, skip, large = ("3", "1", "1") if opts.quick else opts.lora.split(":")
    cmd = [
        sys.executable,
        str(REPO / "tools" / "benchmarks" / "lora.py"),
        "--out",
        str(opts.out),
        "--steps",
        steps,
        "--skip",
        skip,
        "--large-steps",
        large,
    ]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env=subprocess_env(2),
        capture_output=True,
        text=True,
        timeout=7200,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"lora.py failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return json.loads((opts.out / "lora.json").read_text())


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
    parser.add_argument(
        "--real-model",
        default="5:2:1",
        help="SmolLM2-135M vs TRL (real_model.py): STEPS:SKIP:ROUNDS (2 threads per process).",
    )
    parser.add_argument(
        "--lora",
        default="5:2:2",
        help="LoRA vs full fine-tuning and TRL + PEFT (lora.py): STEPS:SKIP:LARGE_STEPS.",
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
    # + rows without a budget and with a smaller and a larger one than the default
    sweep_opts = p.parse_args([*common, "--compare-reward-wait-steps", "0", "32", "128"])
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
    invocation = res["started"]  # stamped on hf_shapes: report.separate tells the runs apart
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
        if "real_model" in only:
            steps, skip, rounds = ("3", "1", "1") if opts.quick else opts.real_model.split(":")
            real_model.add_arguments(p := argparse.ArgumentParser())
            rm_opts = p.parse_args(["--steps", steps, "--skip", skip, "--rounds", rounds])
            print("SmolLM2-135M-Instruct vs TRL ...", flush=True)
            when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
            load = os.getloadavg()
            out = real_model.run(rm_opts, Path(tmp) / "real_model")
            res["real_model"] = {**out, "started": when, "load": load}
            print(real_model.markdown(out), flush=True)
        if "lora" in only:
            print("LoRA: memory and speed, the 1.7B shape, the engine ...", flush=True)
            when = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
            res["lora"] = {**run_lora(opts), "started": when}
        if "hf_shapes" in only:
            print("Llama HF checkpoints: engine vs HF generate, matmul efficiency ...", flush=True)
            res["hf_shapes"] = {**run_hf_shapes(opts, Path(tmp)), "run_started": invocation}
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
    extra = (
        (hf_targets(res["hf_shapes"]) if "hf_shapes" in res else [])
        + (trl_hf_targets(res["trl_hf"]) if "trl_hf" in res else [])
        + (real_model_targets(res["real_model"]) if "real_model" in res else [])
    )
    print("\n".join(targets(res) + extra))
    print(f"wrote {out}/RESULTS.md, benchmarks.png ({res['seconds']:.0f} s of measurements)")


if __name__ == "__main__":
    main()
