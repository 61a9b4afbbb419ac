"""megatron-core's real DynamicInferenceEngine, emulated on CPU, equals the KV-cache runner.

``grpo_testing/emulated_dynamic_engine.py`` runs in a subprocess because it points ``torch.cuda``
at the CPU for the whole process. Needs einops (megatron-core's dynamic attention path uses it).
Every KV-cache mode the installed megatron-core offers (``compat.KV_CACHE_MODES``; ``offload``
from 0.17) gives the local engine's tokens: the weights do not change between windows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[5]


@pytest.mark.parametrize(
    "block_size, kv_cache_mode",
    [(4, "recompute"), (256, "recompute"), (4, "persist"), (4, "offload")],
)
def test_megatron_cores_engine_on_cpu_matches_the_local_engine(block_size, kv_cache_mode):
    pytest.importorskip("einops")
    from megatron.rl.inference.megatron_core.compat import KV_CACHE_MODES

    if kv_cache_mode not in KV_CACHE_MODES:
        pytest.skip(f"this megatron-core has no {kv_cache_mode!r} KV-cache mode")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests/grpo_testing/emulated_dynamic_engine.py"),
            "--block-size",
            str(block_size),
            "--kv-cache-mode",
            kv_cache_mode,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [(r["windows"], r["suspended_first"]) for r in runs] == [
        (False, False),
        (True, False),
        (True, True),  # resumed engines read the reallocated request metadata
    ]
    for run in runs:
        assert run["kv_cache_mode"] == kv_cache_mode
        assert all(run["same_tokens"]), run
        assert run["max_logprob_difference"] < 1e-4, run
        assert run["attention"] == "flash_reference (PyTorch)"
        assert run["megatron_steps"] > 0
