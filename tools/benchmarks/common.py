"""Shared helpers of the benchmarks: machine description, trainer runs, statistics."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tools" / "benchmarks" / "trainer_worker.py"


def machine() -> dict[str, Any]:
    """CPU model and details, core count, memory, Python and library versions."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    simd = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    detail = (
        f"{fields.get('vendor_id', '?')} family {fields.get('cpu family', '?')} model "
        f"{fields.get('model', '?')} stepping {fields.get('stepping', '?')}, "
        f"{fields.get('cpu MHz', '?')} MHz, cache {fields.get('cache size', '?')}, "
        f"{'/'.join(simd) or 'no avx2'}"
    )
    memory = "?"
    try:
        kib = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        memory = f"{kib / 2**20:.0f} GiB"
    except (OSError, IndexError, ValueError):
        pass
    info: dict[str, Any] = {
        "cpu": fields.get("model name", platform.processor() or "unknown"),
        "cpu_detail": detail,
        "cores": os.cpu_count(),
        "memory": memory,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    for name in ("torch", "megatron.core", "transformers", "trl"):
        try:
            module = __import__(name, fromlist=["__version__"])
            info[name] = getattr(module, "__version__", "?")
        except ImportError:
            info[name] = "not installed"
    return info


def replace_paths(value: Any, places: dict[str, str]) -> Any:
    """``value`` (strings, lists, dicts of them) with each path prefix in ``places`` replaced by
    its name (longest prefix first; a prefix ending in ``/`` matches where it stands, any other
    only as a whole name: ``/a/b`` in ``/a/b/c`` and not in ``/a/bc``)."""
    if isinstance(value, dict):
        return {k: replace_paths(v, places) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [replace_paths(v, places) for v in value]
    if not isinstance(value, str):
        return value
    for prefix in sorted(places, key=len, reverse=True):
        end = "" if prefix.endswith("/") else r"(?![\w.-])"  # a whole name, not its start
        value = re.sub(re.escape(prefix) + end, lambda _, name=places[prefix]: name, value)
    return value


def portable(value: Any, **named: Path | None) -> Any:
    """A result with this machine's paths replaced so that committed results name no machine:
    the repository's paths relative to it, the Python interpreter ``python``, the home directory
    ``~``, the temporary directory ``$TMPDIR``, and each of ``named`` (a folder the run was given,
    such as ``--work``) ``$NAME``."""
    places = {
        sys.executable: "python",
        f"{REPO}/": "",
        str(REPO): ".",
        str(Path.home()): "~",
        tempfile.gettempdir(): "$TMPDIR",
    }
    places.update({str(path): f"${key.upper()}" for key, path in named.items() if path})
    return replace_paths(value, places)


def subprocess_env(threads: int) -> dict[str, str]:
    """Environment of a benchmark subprocess: repo importable, ``threads`` intra-op threads."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONWARNINGS"] = "ignore"
    return env


def run_trainer(
    flags: list[str],
    threads: int,
    log: Path,
    timeout_s: float = 600,
    env: dict[str, str] | None = None,
) -> dict:
    """Run ``pretrain_grpo.py``'s ``train`` under ``torchrun`` (one process) with the probes.

    Returns the worker's summary (flags, wall seconds, one record per step). The trainer's
    output goes to ``log``; a failed run raises with the log's tail. ``env``: variables added to
    the worker's environment.
    """
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "summary.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "1",
            str(WORKER),
            "--bench-summary",
            str(summary),
            "--",
            *flags,
        ]
        with open(log, "w", encoding="utf-8") as out:
            proc = subprocess.run(
                cmd,
                cwd=REPO,
                env={**subprocess_env(threads), **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                check=False,
            )
        if proc.returncode != 0:
            tail = "".join(log.read_text(encoding="utf-8").splitlines(keepends=True)[-30:])
            raise RuntimeError(f"trainer run failed ({proc.returncode}): {flags}\n{tail}")
        return json.loads(summary.read_text())


def thread_clocks() -> dict[str, float | None]:
    """CPU time and run-queue wait (seconds) of the calling thread so far.

    ``runq`` is the time the thread was runnable but waiting for a core (Linux
    ``/proc/thread-self/schedstat``; None where unavailable): on a shared machine, wall time minus
    it estimates the wall time without the other jobs. Benchmark processes run one torch thread,
    so the main thread carries all the work.
    """
    try:
        runq: float | None = int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        runq = None
    return {"cpu": time.thread_time(), "runq": runq}


class Stopwatch:
    """Wall time, CPU time and run-queue wait of the calling thread inside a ``with`` block."""

    wall: float = 0.0
    cpu: float = 0.0
    runq: float | None = None

    def __enter__(self) -> Stopwatch:
        self._clocks = thread_clocks()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc_info) -> None:
        self.wall = time.perf_counter() - self._t0
        clocks = thread_clocks()
        self.cpu = clocks["cpu"] - self._clocks["cpu"]
        end, start = clocks["runq"], self._clocks["runq"]
        self.runq = None if end is None or start is None else end - start


COUNTERS = (
    "generated_tokens",
    "engine_steps",
    "engine_rows",
    "engine_seconds",
    "engine_prefill_steps",
    "collect_seconds",
    "train_seconds",
)
"""Per-step counters of ``trainer_worker.py`` summed over a window."""


@dataclass(frozen=True)
class Window:
    """Steady-state totals of one or more trainer runs over their measured steps."""

    steps: int
    seconds: float
    """Wall time from the end of the last skipped step to the end of the last step."""
    cpu_seconds: float
    """CPU time of the main thread over the same interval."""
    runq_seconds: float | None
    """Run-queue wait of the main thread over the same interval (None: not measurable)."""
    counters: dict[str, float]
    """Sums of ``COUNTERS`` over the measured steps."""
    completion_tokens_mean: float

    @property
    def steps_per_s(self) -> float:
        """Training steps per wall-clock second."""
        return self.steps / self.seconds

    @property
    def seconds_per_step(self) -> float:
        """Wall seconds per training step."""
        return self.seconds / self.steps

    @property
    def runq_fraction(self) -> float | None:
        """Share of wall time the main thread waited for a core (contention)."""
        return None if self.runq_seconds is None else self.runq_seconds / self.seconds

    @property
    def uncontended_steps_per_s(self) -> float | None:
        """Steps per second of wall time minus run-queue wait."""
        if self.runq_seconds is None:
            return None
        return self.steps / (self.seconds - self.runq_seconds)


def clock_window(
    stamps: list[dict[str, float | None]], skip: int
) -> tuple[int, float, float, float | None]:
    """(steps, wall, cpu, runq) between stamp ``skip - 1`` and the last stamp.

    ``stamps[i]`` holds ``t`` (wall), ``cpu`` and ``runq`` taken at the end of step i.
    """
    if not 1 <= skip < len(stamps):
        raise ValueError(f"skip={skip} leaves no step of {len(stamps)} to measure")
    a, b = stamps[skip - 1], stamps[-1]
    runq = None if a["runq"] is None or b["runq"] is None else b["runq"] - a["runq"]
    return len(stamps) - skip, b["t"] - a["t"], b["cpu"] - a["cpu"], runq


def window(summary: dict, skip: int) -> Window:
    """Totals over every step of a ``trainer_worker`` summary after the first ``skip``."""
    records = summary["steps"]
    steps, wall, cpu, runq = clock_window(records, skip)
    kept = records[skip:]
    return Window(
        steps=steps,
        seconds=wall,
        cpu_seconds=cpu,
        runq_seconds=runq,
        counters={k: sum(r[k] for r in kept) for k in COUNTERS},
        completion_tokens_mean=statistics.fmean(r["completion_tokens_mean"] for r in kept),
    )


def pooled(windows: list[Window]) -> Window:
    """The windows of several runs of one configuration added up."""
    runqs = [w.runq_seconds for w in windows]
    return Window(
        steps=sum(w.steps for w in windows),
        seconds=sum(w.seconds for w in windows),
        cpu_seconds=sum(w.cpu_seconds for w in windows),
        runq_seconds=None if None in runqs else sum(runqs),
        counters={k: sum(w.counters[k] for w in windows) for k in COUNTERS},
        completion_tokens_mean=statistics.fmean(w.completion_tokens_mean for w in windows),
    )


def spread(values: list[float]) -> str:
    """``min-max`` of per-round values, for the tables."""
    return f"{min(values):.2f}-{max(values):.2f}" if len(values) > 1 else f"{values[0]:.2f}"
