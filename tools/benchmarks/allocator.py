"""The C allocator of a LoRA run at the README recipe's shape: peak resident memory against speed.

    python tools/benchmarks/allocator.py [--steps 4 --skip 1 --rounds 2] [--rank 8]
        [--precision bf16]

``lora.py``'s part 1 setting (SmolLM2-135M-Instruct, 8 prompts x 8 samples of exactly 64 new
tokens, micro-batches of 8, ``--bf16 --recompute-granularity full``, L=0) with LoRA rank
``--rank`` (``--precision fp32``: without ``--bf16``, for a CPU without bfloat16 matrix
instructions, where ``--bf16``'s products are emulated), once per allocator, interleaved over ``--rounds`` (the order reversed every other
round):

* ``glibc``: the C library's ``malloc`` as it is;
* ``glibc, mmap threshold 1 MiB``: ``--malloc-mmap-threshold-kib 1024`` (blocks of 1 MiB and more
  mapped and unmapped one by one);
* ``jemalloc`` and ``tcmalloc``: the distribution's ``libjemalloc.so.2`` and
  ``libtcmalloc_minimal.so.4`` through ``--cpu-allocator`` (the trainer re-executes itself with
  the library preloaded), as PyTorch's CPU performance guide recommends;
* ``jemalloc, pages returned at once``: the same with ``MALLOC_CONF`` telling jemalloc to return
  freed pages to the system at once (``dirty_decay_ms:0,muzzy_decay_ms:0``).

Per allocator: the process's peak resident memory (``VmHWM``, and per phase), wall seconds per
step after ``--skip`` steps, the process's CPU seconds per step (every thread; less sensitive
than wall time to other jobs on the machine), the training update's seconds per step. An
allocator whose library is not installed is reported as missing. Writes ``allocator.json`` and
prints the table; ``benchmarks/results/allocator.md`` is written by hand from it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchmarks.common import REPO, machine, run_trainer  # noqa: E402
from tools.benchmarks.real_model import measure_ours, ours_flags  # noqa: E402

CONFIGS: tuple[tuple[str, list[str], dict[str, str]], ...] = (
    ("glibc", ["--cpu-allocator", "glibc"], {}),
    (
        "glibc, mmap threshold 1 MiB",
        ["--cpu-allocator", "glibc", "--malloc-mmap-threshold-kib", "1024"],
        {},
    ),
    ("jemalloc", ["--cpu-allocator", "jemalloc"], {}),
    (
        "jemalloc, pages returned at once",
        ["--cpu-allocator", "jemalloc"],
        {"MALLOC_CONF": "dirty_decay_ms:0,muzzy_decay_ms:0"},
    ),
    ("tcmalloc", ["--cpu-allocator", "tcmalloc"], {}),
)


def cpu_seconds_per_step(records: list[dict[str, Any]], skip: int) -> float:
    """The process's CPU seconds per step from the end of step ``skip - 1`` to the last."""
    start = records[skip - 1]["process_cpu"] if skip else 0.0
    return (records[-1]["process_cpu"] - start) / (len(records) - skip)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--skip", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", nargs="+", default=None, help="Allocator names to run.")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    opts = parser.parse_args()
    from megatron.rl.models.hf.gguf import SMOLLM2, packaged_checkpoint
    from megatron.trainer.runtime.allocator import library_path

    ckpt = packaged_checkpoint(SMOLLM2)
    lora = ["--lora-rank", str(opts.rank), "--lora-alpha", "32"]
    base = ours_flags(0, opts.precision == "bf16", True, opts, ckpt) + lora
    configs = [c for c in CONFIGS if opts.only is None or c[0] in opts.only]
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in configs}
    missing = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(opts.rounds):
            for name, flags, env in configs if r % 2 == 0 else configs[::-1]:
                library = flags[flags.index("--cpu-allocator") + 1]
                if library != "glibc" and library_path(library) is None:
                    missing.append(name)
                    continue
                print(f"  allocator: round {r + 1}/{opts.rounds}, {name}", flush=True)
                log = Path(tmp) / f"run_{r}.log"
                summary = run_trainer(base + flags, opts.threads, log, timeout_s=3600, env=env)
                numbers = measure_ours(summary, opts.skip)
                numbers["cpu_seconds_per_step"] = cpu_seconds_per_step(summary["steps"], opts.skip)
                runs[name].append(numbers)
    rows = []
    for name, flags, env in configs:
        if not runs[name]:
            continue
        row = {k: statistics.fmean(run[k] for run in runs[name]) for k in runs[name][0]}
        row.update(
            name=name,
            flags=flags,
            env=env,
            peak_rss_mib=max(run["peak_rss_mib"] for run in runs[name]),
            seconds_per_step_per_round=[run["seconds_per_step"] for run in runs[name]],
        )
        rows.append(row)
    reference = rows[0]
    print("| allocator | peak RSS | s/step | vs glibc | CPU s/step | vs glibc | update s/step |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['name']} | {row['peak_rss_mib']:.0f} MiB | {row['seconds_per_step']:.2f} | "
            f"{row['seconds_per_step'] / reference['seconds_per_step']:.2f}x | "
            f"{row['cpu_seconds_per_step']:.1f} | "
            f"{row['cpu_seconds_per_step'] / reference['cpu_seconds_per_step']:.2f}x | "
            f"{row['train_seconds_per_step']:.2f} |"
        )
    result = {"machine": machine(), "settings": vars(opts) | {"out": None}, "rows": rows}
    result["missing"] = sorted(set(missing))
    opts.out.mkdir(parents=True, exist_ok=True)
    name = "allocator.json" if opts.precision == "bf16" else f"allocator_{opts.precision}.json"
    (opts.out / name).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
