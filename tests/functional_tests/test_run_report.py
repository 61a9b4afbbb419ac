"""The README's main command under torchrun: its output starts with the header and ends with the
summary and the path of the curves PNG, which exists; megatron-core's kernel warnings are
condensed into the header."""

from __future__ import annotations

import subprocess

from golden_values import ROOT, subprocess_env, training_command


def test_a_short_default_run_explains_itself(tmp_path):
    env = subprocess_env()
    cmd = training_command(
        1, {"rl-forced-lag": 2, "train-iters": 5, "plot-file": tmp_path / "curves.png"}
    )
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("model ") and "parameters" in lines[0]
    assert [line.split()[0] for line in lines[:7]] == [
        "model",
        "tokenizer",
        "environments",
        "rollouts",
        "parallelism",
        "outputs",
        "kernels",
    ]
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 5 and all(" | elapsed " in s and " | eta " in s for s in steps)
    assert lines[-3].startswith("done         5 steps (0..4)")
    assert lines[-2].startswith("staleness    exact")
    assert lines[-1] == f"curves       {tmp_path / 'curves.png'}"
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert "not installed" not in proc.stderr
