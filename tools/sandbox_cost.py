"""Wall time of one python-tool call, bubblewrap sandbox against the in-process audit hook.

    python tools/sandbox_cost.py [--calls 40]

Runs ``print(1)`` (the fixed cost: start, limits, exit) and a small computation through
``megatron.rl.tools.sandbox.run_python`` with each isolation, interleaved, and prints the median
and 90th percentile of each, and the sandbox's extra milliseconds per call.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.rl.tools.sandbox import ISOLATIONS, run_python  # noqa: E402

PROGRAMS = {
    "print(1)": "print(1)",
    "sum of squares": "print(sum(i * i for i in range(200000)))",
}


async def measure(calls: int) -> dict[tuple[str, str], list[float]]:
    """Seconds per call of every (program, isolation), interleaved."""
    seconds: dict[tuple[str, str], list[float]] = {}
    for _ in range(calls):
        for program, code in PROGRAMS.items():
            for isolation in ISOLATIONS:
                started = time.perf_counter()
                await run_python(code, isolation=isolation)
                seconds.setdefault((program, isolation), []).append(time.perf_counter() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=40, help="Calls per (program, isolation).")
    opts = parser.parse_args()
    seconds = asyncio.run(measure(opts.calls))
    print("| program | isolation | median ms | p90 ms |")
    print("|---|---|---|---|")
    for (program, isolation), values in seconds.items():
        p90 = statistics.quantiles(values, n=10)[-1]
        print(
            f"| {program} | {isolation} | {statistics.median(values) * 1e3:.0f} | {p90 * 1e3:.0f} |"
        )
    for program in PROGRAMS:
        extra = statistics.median(seconds[(program, "bubblewrap")]) - statistics.median(
            seconds[(program, "unsafe-audit-hook")]
        )
        print(f"{program}: the sandbox adds {extra * 1e3:.0f} ms per call (median)")


if __name__ == "__main__":
    main()
