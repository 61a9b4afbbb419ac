"""Resident memory of a training run, phase by phase: where the peak comes from.

    python tools/benchmarks/memory_phases.py [--steps 3] [-- extra pretrain_grpo.py flags]

Runs ``pretrain_grpo.py`` in this process at the README recipe's shape (SmolLM2-135M-Instruct,
8 prompts x 8 samples of exactly 64 tokens, micro-batches of 8, ``--bf16 --recompute-granularity
full``, L=0; flags after ``--`` are added) with a thread sampling the process's resident set
(``VmRSS``) every 10 ms, and prints, at each phase boundary (start-up, each step's generation
window, its pi_old collection and its training update), the resident memory there and the highest
value sampled since the previous boundary. The difference between a phase's peak and what stays
resident after it is what the phase held while it ran; what stays resident and is not a live
tensor is memory the C allocator kept.
"""

from __future__ import annotations

import runpy
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def resident_mib() -> int:
    """This process's resident set (``/proc/self/status``), MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


class PhaseMemory:
    """The sampler thread and the boundaries' report."""

    def __init__(self) -> None:
        self.peak = 0
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, resident_mib())
            time.sleep(0.01)

    def mark(self, where: str) -> None:
        now = resident_mib()
        print(
            f"memory: {where:<42} resident {now:5d} MiB, peak since the last mark "
            f"{max(self.peak, now):5d} MiB",
            flush=True,
        )
        self.peak = now

    def around(self, owner: type, method: str, name: str) -> None:
        """Mark before and after every call of ``owner.method``."""
        original = getattr(owner, method)

        def wrapped(*args, **kwargs):
            self.mark(f"before {name}")
            try:
                return original(*args, **kwargs)
            finally:
                self.mark(f"after {name}")

        setattr(owner, method, wrapped)


def main() -> None:
    extra = sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else []
    own = sys.argv[1 : sys.argv.index("--")] if "--" in sys.argv else sys.argv[1:]
    steps = int(own[own.index("--steps") + 1]) if "--steps" in own else 3

    from megatron.rl.models.hf.gguf import SMOLLM2, packaged_checkpoint

    checkpoint = packaged_checkpoint(SMOLLM2)
    memory = PhaseMemory()
    memory.mark("start (interpreter and this tool)")
    import megatron.trainer.generation.host as generation
    import megatron.trainer.grpo as grpo

    memory.around(grpo, "build_run", "start-up (model, optimizer, load)")
    memory.around(generation.GenerationHost, "window", "a generation window")
    memory.around(grpo.Run, "collection", "the collection (pi_old)")
    memory.around(grpo.Run, "train_step", "the training update")
    sys.argv = [
        "pretrain_grpo.py",
        "--hf-checkpoint",
        str(checkpoint),
        "--env-config",
        str(REPO / "examples" / "rl" / "environment_configs" / "arithmetic.yaml"),
        "--seq-length",
        "256",
        "--bf16",
        "--recompute-granularity",
        "full",
        "--rl-forced-lag",
        "0",
        "--grpo-prompts-per-step",
        "8",
        "--grpo-group-size",
        "8",
        "--micro-batch-size",
        "8",
        "--lr",
        "2e-5",
        "--lr-warmup-iters",
        "2",
        "--train-iters",
        str(steps),
        "--rl-ignore-eos",
        "--plot-file",
        "none",
        *extra,
    ]
    runpy.run_path(str(REPO / "pretrain_grpo.py"), run_name="__main__")


if __name__ == "__main__":
    main()
