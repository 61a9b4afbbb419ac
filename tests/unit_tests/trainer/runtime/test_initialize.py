"""``initialize_distributed`` for a process that no launcher started."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]

PROGRAM = """
from megatron.trainer.flags.parse import parse_args
from megatron.trainer.runtime.initialize import initialize_distributed, shutdown_distributed
ctx = initialize_distributed(parse_args([]))
print("world", ctx.world_size)
shutdown_distributed()
"""


def test_a_single_process_takes_a_fresh_port_over_an_inherited_master_port_still_held():
    """A ``MASTER_PORT`` left in the environment (a shell, a parent that ran a world of its own)
    whose port is still listening must not stop a one-process run (seen: EADDRINUSE)."""
    world = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        env = {k: v for k, v in os.environ.items() if k not in world}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(held.getsockname()[1]))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        proc = subprocess.run(
            [sys.executable, "-c", PROGRAM],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "world 1" in proc.stdout
