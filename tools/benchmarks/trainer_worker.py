"""Runs ``pretrain_grpo.py``'s training entry with timing probes; used by the benchmarks.

    torchrun --standalone --nproc-per-node 1 tools/benchmarks/trainer_worker.py \
        --bench-summary OUT.json -- <pretrain_grpo.py flags>

It is ``train(parse_args(flags))``, exactly what ``pretrain_grpo.py`` runs, with two read-only
probes added in this process (nothing under ``megatron/`` is changed):

* ``StepGroup.step`` is wrapped to count, per training step, the engine steps that also
  prefill a newly admitted prompt and the most requests one step decoded (the step metrics
  already carry the engine steps, their rows and seconds: ``engine_metrics``);
* ``MetricsWriter.write`` is wrapped to keep each step's metrics with the wall clock, the
  process's CPU time (every thread), the main thread's CPU time and its run-queue wait (``common.thread_clocks``) at the end of the step;
* ``RolloutSource.next_batch`` (the generation window) and ``Policy.train`` of the CPU tier's
  policy (the training update) are wrapped to record each phase's peak resident memory: the
  kernel's high-water mark (``VmHWM``) is reset when the phase starts (``/proc/self/clear_refs``)
  and read when it ends, with the resident memory at both ends (``phase_memory``).

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
from megatron.trainer.flags.parse import parse_args  # noqa: E402
from megatron.trainer.generation import rollouts as rollouts_module  # noqa: E402
from megatron.trainer.grpo import train  # noqa: E402
from megatron.trainer.metrics import record as metrics_module  # noqa: E402
from megatron.trainer.tiers import cpu as cpu_tier  # noqa: E402
from tools.benchmarks.common import thread_clocks  # noqa: E402


class Probes:
    """Per-step engine counters and metric records collected while training runs."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.records: list[dict[str, Any]] = []
        self._max_rows = 0
        self._prefill_steps = 0
        self._phases: dict[str, dict[str, float]] = {}
        self.peak_mib = 0.0
        """The process's peak resident memory so far (the phases reset the kernel's)."""

    def on_engine_step(self, rows: int, prefill: bool) -> None:
        """Count one engine step of ``rows`` requests (``prefill``: some feed their prompt)."""
        self._max_rows = max(self._max_rows, rows)
        self._prefill_steps += prefill

    def on_phase(self, phase: str, before: dict[str, float], after: dict[str, float]) -> None:
        """Keep one phase's memory: resident at its start and end, its peak."""
        self._phases[phase] = {
            "rss_start_mib": before["rss"],
            "rss_end_mib": after["rss"],
            "peak_mib": after["peak"],
        }

    def on_metrics(self, metrics: dict[str, Any]) -> None:
        """Close the current step: keep its metrics, its engine counters and the time."""
        rows = round(metrics["engine_rows_per_step"] * metrics["engine_steps"])
        self.records.append(
            {
                "t": time.perf_counter() - self.start,
                "process_cpu": time.process_time(),
                **thread_clocks(),
                "engine_rows": rows,
                "engine_max_rows": self._max_rows,
                "engine_prefill_steps": self._prefill_steps,
                "phase_memory": self._phases,
                **metrics,
            }
        )
        self._max_rows = self._prefill_steps = 0
        self._phases = {}


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
    rollouts_module.RolloutSource.next_batch = measured(
        rollouts_module.RolloutSource.next_batch, "generation", probes
    )
    cpu_tier.CPUPolicy.train = measured(cpu_tier.CPUPolicy.train, "training", probes)


def memory() -> dict[str, float]:
    """Resident memory and its high-water mark since the last reset (MiB; Linux)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            fields[line[:5]] = int(line.split()[1]) / 1024
    return {"rss": fields.get("VmRSS", float("nan")), "peak": fields.get("VmHWM", float("nan"))}


def measured(method, phase: str, probes: Probes):
    """``method`` with its phase's memory recorded: the high-water mark reset at its start."""

    def wrapper(*args, **kwargs):
        probes.peak_mib = max(probes.peak_mib, memory()["peak"])  # before the reset loses it
        try:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        except OSError:
            pass
        before = memory()
        result = method(*args, **kwargs)
        after = memory()
        probes.peak_mib = max(probes.peak_mib, after["peak"])
        probes.on_phase(phase, before, after)
        return result

    return wrapper


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
    rusage_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    summary["peak_rss_mib"] = max(probes.peak_mib, memory()["peak"], rusage_peak)
    Path(opts.bench_summary).write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
