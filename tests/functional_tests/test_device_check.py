"""``tools/device_check.sh --dry-run``: the prepared GPU check, every part at a tiny shape on the
CPU tier, so that the script and its report cannot rot between GPU lendings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from golden_values import ROOT, subprocess_env

PARTS = [
    "a_gpu_tests",
    "b_engine_batch8",
    "b_engine_batch16",
    "b_local_engine_batch8",
    "c_grpo_lag0",
    "c_grpo_lag2",
    "d_refit_bandwidth",
]


def test_the_dry_run_runs_every_part_and_writes_the_report(tmp_path: Path):
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", "tools/device_check.sh", str(out), "--dry-run"],
        cwd=ROOT,
        env={**subprocess_env(), "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu.json").read_text())
    assert [p["part"] for p in report["parts"]] == PARTS
    assert all(p["ok"] for p in report["parts"]), report["parts"]
    parts = {p["part"]: p for p in report["parts"]}
    assert "collected" in parts["a_gpu_tests"]["summary"]
    trained = parts["b_engine_batch8"]["bench"]
    assert trained["shape"] == "tiny" and trained["train_tokens_per_s"] > 0
    for name in ("b_engine_batch8", "b_engine_batch16", "b_local_engine_batch8"):
        bench = parts[name]["bench"]
        assert bench["generated_tokens_per_s"] > 0 and bench["decode_bytes_needed"] > 0
    for lag in (0, 2):
        grpo = parts[f"c_grpo_lag{lag}"]["grpo"]
        assert grpo["steps"] == 2 and grpo["step_seconds"] > 0
    refit = parts["d_refit_bandwidth"]["refit"]
    paths = {"device_copy", "device_to_host", "host_to_device", "gloo_broadcast"}  # no CUDA IPC
    assert set(refit["paths"]) == paths and refit["shape"] == "tiny"
    assert all(p["seconds"] > 0 and p["gb_per_s"] > 0 for p in refit["paths"].values())
    assert all(share > 0 for share in report["refit_share_of_step"].values())
    assert report["dry_run"] and "CPU dry run" in (out / "gpu.md").read_text()
