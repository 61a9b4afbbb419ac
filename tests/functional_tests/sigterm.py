"""Stopping a training run with SIGTERM, as a terminal or a job scheduler does, once it has
logged some steps: its exit status, how long it took to exit and what it printed."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from golden_values import ROOT, subprocess_env


def stop_with_sigterm(
    cmd: list[str], metrics: Path, after_steps: int, process_group: bool = False
) -> tuple[int, float, str]:
    """Start ``cmd``, send SIGTERM to it (``process_group``: to its whole process group, as a
    terminal or a job scheduler does) after ``after_steps`` steps; (status, seconds to exit after
    the signal, stdout)."""
    with (
        open(metrics.with_suffix(".out"), "w") as out,
        open(metrics.with_suffix(".err"), "w") as err,
    ):
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=subprocess_env(),
            stdout=out,
            stderr=err,
            start_new_session=process_group,
        )
        deadline = time.monotonic() + 300
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= after_steps):
            assert proc.poll() is None, metrics.with_suffix(".err").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        signalled = time.monotonic()
        if process_group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=120)
        seconds = time.monotonic() - signalled
    return status, seconds, metrics.with_suffix(".out").read_text()
