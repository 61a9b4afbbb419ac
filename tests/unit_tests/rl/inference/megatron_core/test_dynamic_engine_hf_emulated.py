"""megatron-core's DynamicInferenceEngine (CPU-emulated) on an HF Llama-3 RoPE model equals the
local engine: RoPE through megatron-core's own inference path with the exact scaled frequencies.

Runs ``grpo_testing/emulated_dynamic_engine_hf.py`` in a subprocess (it patches ``torch.cuda``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[5]


def test_megatron_cores_engine_matches_the_local_engine_on_a_rope_model(tiny_hf_checkpoints):
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests/grpo_testing/emulated_dynamic_engine_hf.py"),
            str(tiny_hf_checkpoints["llama3"]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert all(run["same_tokens"]), run
    assert run["lengths"] == [12, 16, 10, 14]  # no early stop hides a difference
    assert run["max_logprob_difference"] < 1e-4, run
    assert run["megatron_steps"] > 0 and run["rotary"] == "PositionalRotaryEmbedding"
