"""Golden-value regression cases: run a case's training command, compare per-step metrics.

A case is a folder ``test_cases/<name>/`` with ``model_config.yaml``::

    nproc_per_node: 1          # torchrun processes
    args: {rl-forced-lag: 2, train-iters: 12}   # flags of pretrain_grpo.py
    tolerances:                # per metric: |actual - golden| <= atol + rtol * |golden|
      loss: {rtol: 1.0e-4, atol: 1.0e-6}
      staleness_mean: {rtol: 0, atol: 0}

and ``golden_values.json`` holding ``{metric: [value per step]}`` for the metrics listed in
``tolerances``.

    python tests/functional_tests/golden_values.py --case grpo_tiny_lag2            # compare
    python tests/functional_tests/golden_values.py --case grpo_tiny_lag2 --update   # rewrite
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

CASES = Path(__file__).parent / "test_cases"
ROOT = Path(__file__).resolve().parents[2]


def load_case(name: str) -> dict:
    """The parsed ``model_config.yaml`` of case ``name``."""
    return yaml.safe_load((CASES / name / "model_config.yaml").read_text())


def training_command(nproc: int, args: dict) -> list[str]:
    """The torchrun command line of pretrain_grpo.py with ``args`` (flag name -> value)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [f"--{k}={v}" for k, v in args.items()]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={port}", "pretrain_grpo.py", *argv]  # fmt: skip


def subprocess_env() -> dict[str, str]:
    """Environment of spawned trainers/servers: one thread each, tests/ importable."""
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path)


def run_training(nproc: int, args: dict, timeout: float = 600) -> list[dict]:
    """Run pretrain_grpo.py under torchrun with ``args`` and return its per-step metrics."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        cmd = training_command(nproc, {**args, "metrics-file": metrics})
        env = subprocess_env()
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
            )
        return [json.loads(line) for line in metrics.read_text().splitlines()]


def run_case(name: str) -> list[dict]:
    """Per-step metrics of case ``name``."""
    case = load_case(name)
    return run_training(case["nproc_per_node"], case["args"])


def compare(name: str, metrics: list[dict]) -> list[str]:
    """Mismatches between ``metrics`` and the case's golden values (empty when all match)."""
    case = load_case(name)
    golden = json.loads((CASES / name / "golden_values.json").read_text())
    problems = []
    for metric, tol in case["tolerances"].items():
        want = golden[metric]
        got = [m[metric] for m in metrics]
        if len(got) != len(want):
            problems.append(f"{metric}: {len(got)} steps, golden has {len(want)}")
            continue
        for step, (g, w) in enumerate(zip(got, want)):
            if abs(g - w) > tol["atol"] + tol["rtol"] * abs(w):
                problems.append(f"{metric} step {step}: got {g!r}, golden {w!r} ({tol})")
    return problems


def update(name: str, metrics: list[dict]) -> None:
    """Rewrite the golden values of case ``name`` from ``metrics``."""
    case = load_case(name)
    golden = {metric: [m[metric] for m in metrics] for metric in case["tolerances"]}
    path = CASES / name / "golden_values.json"
    path.write_text(json.dumps(golden, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--case", action="append", help="case name (default: all cases)")
    parser.add_argument("--update", action="store_true", help="rewrite the golden values")
    opts = parser.parse_args()
    failed = False
    for name in opts.case or sorted(p.name for p in CASES.iterdir() if p.is_dir()):
        metrics = run_case(name)
        if opts.update:
            update(name, metrics)
            print(f"{name}: golden values updated ({len(metrics)} steps)")
            continue
        problems = compare(name, metrics)
        failed |= bool(problems)
        print(f"{name}: " + ("OK" if not problems else "MISMATCH\n  " + "\n  ".join(problems)))
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
