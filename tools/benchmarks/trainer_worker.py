"""Runs ``pretrain_grpo.py``'s training entry with timing probes; used by the benchmarks.

    torchrun --standalone --nproc-per-node 1 tools/benchmarks/trainer_worker.py \
        --bench-summary OUT.json -- <pretrain_grpo.py flags>

It is ``train(parse_args(flags))``, exactly what ``pretrain_grpo.py`` runs, with two read-only
probes added in this process (nothing under ``megatron/`` is changed):

* ``StepGroup.step`` is wrapped to count, per training step, the engine steps that also
  prefill a newly admitted prompt and the most requests one step decoded (the step metrics
  already carry the engine steps, their rows and seconds: ``engine_metrics``);
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
        self._max_rows = 0
        self._prefill_steps = 0

    def on_engine_step(self, rows: int, prefill: bool) -> None:
        """Count one engine step of ``rows`` requests (``prefill``: some feed their prompt)."""
        self._max_rows = max(self._max_rows, rows)
        self._prefill_steps += prefill

    def on_metrics(self, metrics: dict[str, Any]) -> None:
        """Close the current step: keep its metrics, its engine counters and the time."""
        rows = round(metrics["engine_rows_per_step"] * metrics["engine_steps"])
        self.records.append(
            {
                "t": time.perf_counter() - self.start,
                **thread_clocks(),
                "engine_rows": rows,
                "engine_max_rows": self._max_rows,
                "engine_prefill_steps": self._prefill_steps,
                **metrics,
            }
        )
        self._max_rows = self._prefill_steps = 0


def install(probes: Probes) -> None:
    """Wrap ``StepGroup.step`` and ``MetricsWriter.write`` to feed ``probes``."""
    step = StepGroup.step
    write = metrics_module.MetricsWriter.write

    def counted_step(self: StepGroup, plan):
        rows = [row for replica in plan.rows for row in replica]
        probes.on_engine_step(len(rows), any(len(row.tokens) > 1 for row in rows))
        return step(self, plan)

    def recorded_write(self, metrics: dict[str, Any]) -> None:
        write(self, metrics)
        probes.on_metrics(metrics)

    StepGroup.step = counted_step
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
