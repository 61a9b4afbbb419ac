"""How much slower (or faster) ``--bf16``'s matrix products are than float32 on this CPU: the
check behind the CPU tier's header line about bfloat16 matrix instructions.

    python tools/benchmarks/cpu_bf16.py [--repeats 5] [--out benchmarks/results]

Times SmolLM2-135M's products at the recipe's micro-batch (8 rows x 128 tokens): an MLP
projection (1024 x 576 by 576 x 1536) and the output layer's weight gradient (the transposed
1024 x 49152 logits' gradient by 1024 x 576), each in float32, in bfloat16 and in float32
under ``torch.autocast(cpu, bfloat16)`` (what ``--bf16`` runs), interleaved so that the ratios
are measured side by side. Reports the median seconds, the ratio to float32 and whether oneDNN
finds bfloat16 instructions (``megatron.trainer.tiers.cpu.bf16_products_native``). Writes
``cpu_bf16.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tools.benchmarks.common import machine  # noqa: E402

SHAPES = {
    "mlp projection (1024x576 @ 576x1536)": ((1024, 576), (576, 1536), False),
    "output weight gradient (1024x49152 ^T @ 1024x576)": ((1024, 49152), (1024, 576), True),
}


def timed(a: torch.Tensor, b: torch.Tensor, transpose: bool, mode: str) -> float:
    """Seconds of one product in ``mode`` (float32, bfloat16 or autocast)."""
    if mode == "bfloat16":
        a, b = a.bfloat16(), b.bfloat16()
    left = a.t() if transpose else a
    began = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        torch.matmul(left, b)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from megatron.trainer.tiers.cpu import bf16_products_native

    modes = ("float32", "bfloat16", "autocast")
    results = {}
    for name, (shape_a, shape_b, transpose) in SHAPES.items():
        a, b = torch.randn(shape_a), torch.randn(shape_b)
        times: dict[str, list[float]] = {m: [] for m in modes}
        for m in modes:  # warm-up
            timed(a, b, transpose, m)
        for _ in range(args.repeats):
            for m in modes:
                times[m].append(timed(a, b, transpose, m))
        median = {m: statistics.median(t) for m, t in times.items()}
        results[name] = {
            "seconds": median,
            "ratio_to_float32": {m: median[m] / median["float32"] for m in modes},
        }
        print(
            f"{name}: "
            + ", ".join(
                f"{m} {median[m] * 1e3:.1f} ms ({median[m] / median['float32']:.2f}x)"
                for m in modes
            ),
            flush=True,
        )
    native = bf16_products_native()
    print(
        f"bfloat16 matrix instructions (oneDNN): {native}; cpu capability {torch.backends.cpu.get_cpu_capability()}"
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        report = {
            "machine": machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "bf16_products_native": native,
            "threads": torch.get_num_threads(),
            "repeats": args.repeats,
            "results": results,
        }
        (args.out / "cpu_bf16.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
