"""megatron-core's real DynamicInferenceEngine, emulated on CPU, equals the KV-cache runner.

``grpo_testing/emulated_dynamic_engine.py`` runs in a subprocess because it points ``torch.cuda``
at the CPU for the whole process. Needs einops (megatron-core's dynamic attention path uses it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[5]


@pytest.mark.parametrize("block_size", [4, 256])
def test_megatron_cores_engine_on_cpu_matches_the_local_engine(block_size):
    pytest.importorskip("einops")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests/grpo_testing/emulated_dynamic_engine.py"),
         "--block-size", str(block_size)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [(r["windows"], r["suspended_first"]) for r in runs] == [
        (False, False),
        (True, False),
        (True, True),  # resumed engines read the reallocated request metadata
    ]
    for run in runs:
        assert all(run["same_tokens"]), run
        assert run["max_logprob_difference"] < 1e-4, run
        assert run["attention"] == "flash_reference (PyTorch)"
        assert run["megatron_steps"] > 0
