"""megatron-core's DynamicInferenceEngine (CPU-emulated) on a tiny Qwen3-MoE checkpoint: the local
engine's tokens, and per request the routes of the rows it fed, recorded from the engine's packed
forwards, equal one full forward's routes on prompt + generated[:-1] (also across suspend/resume
windows, where megatron-core re-prefills requests in flight).

Runs ``grpo_testing/emulated_dynamic_engine_moe.py`` in a subprocess (it patches ``torch.cuda``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[5]


def test_megatron_cores_engine_generates_and_records_the_routes_of_an_moe_model(
    tiny_hf_checkpoints,
):
    pytest.importorskip("einops")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests/grpo_testing/emulated_dynamic_engine_moe.py"),
            str(tiny_hf_checkpoints["qwen3_moe"]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["windows"] for r in runs] == [False, True]
    for run in runs:
        assert all(run["same_tokens"]), run
        assert min(run["lengths"]) > 4 and run["max_logprob_difference"] < 1e-4, run
        assert all(run["routes_complete"]) and all(run["same_routes"]), run
        assert run["differing_rows"] == [0] * len(run["lengths"]), run
    assert runs[0]["re_prefills"] == 0 and runs[1]["re_prefills"] > 0
