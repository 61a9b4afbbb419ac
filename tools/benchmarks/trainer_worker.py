"""Runs ``pretrain_grpo.py``'s training entry with timing probes; used by the benchmarks.

    torchrun --standalone --nproc-per-node 1 tools/benchmarks/trainer_worker.py \
        --bench-summary OUT.json -- <pretrain_grpo.py flags>

It is ``train(parse_args(flags))``, exactly what ``pretrain_grpo.py`` runs, with two read-only
probes added in this process (nothing under ``megatron/`` is changed):

* ``StepGroup.step`` is wrapped to count, per training step, the engine steps, the requests
  decoded in each (the engine's active requests: every active request steps in a window) and the
  seconds spent in them;
* ``MetricsWriter.write`` is wrapped to keep each step's metrics with the wall clock, the main
  thread's CPU time and its run-queue wait (``common.thread_clocks``) at the end of the step.

The summary JSON holds one record per step, so the caller measures time between steps (start-up
and pipeline fill can be excluded), the mean decode batch size and how contended the machine was.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megatron.rl.inference.step_group import StepGroup  # noqa: E402
from megatron.trainer import metrics as metrics_module  # noqa: E402
from megatron.trainer.arguments import parse_args  # noqa: E402
from megatron.trainer.grpo import train  # noqa: E402
from tools.benchmarks.common import thread_clocks  # noqa: E402


class Probes:
    """Per-step engine counters and metric records collected while training runs."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.records: list[dict[str, Any]] = []
        self._engine_steps = 0
        self._engine_rows = 0
        self._engine_seconds = 0.0
        self._max_rows = 0
        self._prefill_steps = 0

    def on_engine_step(self, rows: int, prefill: bool, seconds: float) -> None:
        """Count one engine step of ``rows`` requests (``prefill``: some feed their prompt)."""
        self._engine_steps += 1
        self._engine_rows += rows
        self._engine_seconds += seconds
        self._max_rows = max(self._max_rows, rows)
        self._prefill_steps += prefill

    def on_metrics(self, metrics: dict[str, Any]) -> None:
        """Close the current step: keep its metrics, its engine counters and the time."""
        self.records.append(
            {
                "t": time.perf_counter() - self.start,
                **thread_clocks(),
                "engine_steps": self._engine_steps,
                "engine_rows": self._engine_rows,
                "engine_seconds": self._engine_seconds,
                "engine_max_rows": self._max_rows,
                "engine_prefill_steps": self._prefill_steps,
                **metrics,
            }
        )
        self._engine_steps = self._engine_rows = self._max_rows = self._prefill_steps = 0
        self._engine_seconds = 0.0


def install(probes: Probes) -> None:
    """Wrap ``StepGroup.step`` and ``MetricsWriter.write`` to feed ``probes``."""
    step = StepGroup.step
    write = metrics_module.MetricsWriter.write

    def timed_step(self: StepGroup, plan):
        t0 = time.perf_counter()
        out = step(self, plan)
        rows = [row for replica in plan.rows for row in replica]
        prefill = any(len(row.tokens) > 1 for row in rows)
        probes.on_engine_step(len(rows), prefill, time.perf_counter() - t0)
        return out

    def recorded_write(self, metrics: dict[str, Any]) -> None:
        write(self, metrics)
        probes.on_metrics(metrics)

    StepGroup.step = timed_step
    metrics_module.MetricsWriter.write = recorded_write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bench-summary", required=True, help="Write the summary JSON here.")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="-- then pretrain_grpo.py flags")
    opts = parser.parse_args()
    flags = opts.flags[1:] if opts.flags[:1] == ["--"] else opts.flags
    probes = Probes()
    install(probes)
    train(parse_args(flags))
    summary = {"flags": flags, "wall_seconds": time.perf_counter() - probes.start}
    summary["steps"] = probes.records
    summary["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(opts.bench_summary).write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
