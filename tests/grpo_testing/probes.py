"""Statements run in a fresh Python process, for what a test cannot see in its own (which has
long imported torch)."""

from __future__ import annotations

import subprocess
import sys


def loads_torch(statements: str) -> tuple[str, bool]:
    """(what ``statements`` print, stripped; whether torch was imported by their end) in a fresh
    interpreter."""
    code = f"{statements}\nimport sys\nprint('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    *printed, torch_loaded = out.stdout.strip().splitlines()
    return "\n".join(printed).strip(), torch_loaded == "True"
