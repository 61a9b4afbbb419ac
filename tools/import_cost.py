"""What a process of ours pays to start and to end, measured side by side in fresh interpreters.

    python tools/import_cost.py [--rounds 5] [--json FILE]

Each round runs, one after the other, in new processes:

* ``import megatron.core`` alone (megatron-core's own import: its ``torch.compile`` decorators
  import TorchDynamo and Inductor) and ``import megatron.rl`` first, then ``import megatron.core``
  (``megatron/rl/deferred_compile.py``: compilation deferred to a function's first call);
* the time from the last statement of a process that imported the trainer
  (``megatron.trainer.grpo``) to the end of the process, with the interpreter's usual shutdown and
  with ``gc.freeze`` as the last ``atexit`` handler (``megatron/trainer/runtime/exits.py``).

Medians over the rounds and their ratios are printed (and written as JSON with ``--json``).
These machines are noisy: only the ratios of one run compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

IMPORT = (
    "import time, torch\n"
    "{first}"
    "t = time.perf_counter()\n"
    "import megatron.core\n"
    "print(time.perf_counter() - t)\n"
)
EXIT = (
    "import atexit, gc, time\n"
    "import megatron.trainer.grpo\n"
    "{freeze}"
    "print(time.time(), flush=True)\n"
)

CASES = {  # name -> (code, whether it prints the time of its last statement rather than seconds)
    "import_megatron_core": (IMPORT.format(first=""), False),
    "import_megatron_core_deferred": (IMPORT.format(first="import megatron.rl\n"), False),
    "exit_after_trainer_import": (EXIT.format(freeze=""), True),
    "exit_after_trainer_import_frozen": (EXIT.format(freeze="atexit.register(gc.freeze)\n"), True),
}


def measure(code: str, until_exit: bool) -> float:
    """Seconds: the import the code times, or (``until_exit``) from the time its last statement
    prints to the end of the process."""
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    ended = time.time()
    printed = float(proc.stdout.split()[-1])
    return ended - printed if until_exit else printed


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="Rounds of every case.")
    parser.add_argument("--json", type=Path, default=None, help="Also write the results here.")
    args = parser.parse_args(argv)
    seconds: dict[str, list[float]] = {name: [] for name in CASES}
    for _ in range(args.rounds):
        for name, (code, until_exit) in CASES.items():
            seconds[name].append(measure(code, until_exit))
    median = {name: statistics.median(values) for name, values in seconds.items()}
    result = {
        "rounds": args.rounds,
        "median_seconds": median,
        "import_deferred_over_plain": median["import_megatron_core_deferred"]
        / median["import_megatron_core"],
        "exit_frozen_over_plain": median["exit_after_trainer_import_frozen"]
        / median["exit_after_trainer_import"],
    }
    for name, value in median.items():
        print(f"{name:34s} {value:6.3f} s (median of {args.rounds})")
    print(f"deferred / plain import: {result['import_deferred_over_plain']:.2f}")
    print(f"frozen / plain exit:     {result['exit_frozen_over_plain']:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
