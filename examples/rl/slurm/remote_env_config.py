"""Wait for an env server, then write the env config that points a trainer at it.

    python examples/rl/slurm/remote_env_config.py --url http://node7:8000 --output remote.yaml

One ``remote`` entry per environment the server's ``GET /health`` lists, with the same env id
and mixture weight, so metrics keep their per-environment names; evaluation-only environments
(weight 0) are left out, since the trainer evaluates in-process environments only. Used by
``train_grpo.sh``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import httpx
import yaml


def wait_for_health(url: str, timeout_s: float, server_pid: int | None = None) -> dict:
    """The ``/health`` answer of the env server at ``url``, polling until it is ready."""
    deadline = time.monotonic() + timeout_s
    last_error = "no answer yet"
    while time.monotonic() < deadline:
        if server_pid is not None and not _alive(server_pid):
            raise SystemExit(f"env server {url}: its process {server_pid} exited before /health")
        try:
            response = httpx.get(f"{url}/health", timeout=5.0, headers=_auth_headers())
            if response.status_code == 200:
                return response.json()
            last_error = f"HTTP {response.status_code}"
        except httpx.TransportError as exc:
            last_error = str(exc) or type(exc).__name__
        time.sleep(1.0)
    raise SystemExit(f"env server {url}: /health not ready within {timeout_s:.0f} s ({last_error})")


def _auth_headers() -> dict[str, str]:
    """The job's key (``MEGATRON_RL_API_KEY``), which the env server requires, as a header."""
    key = os.environ.get("MEGATRON_RL_API_KEY")
    return {"authorization": f"Bearer {key}"} if key else {}


def remote_entries(url: str, health: dict) -> list[dict]:
    """Env-config entries of ``agent_type: remote`` for every environment in ``health``."""
    return [
        {
            "agent_type": "remote",
            "env_id": env["env_id"],
            "agent_args": {"url": url, "env_id": env["env_id"]},
            "weight": env["weight"],
        }
        for env in health["environments"]
        if env["weight"] > 0
    ]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child (exited, not yet reaped by the batch script) counts as gone.
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[-1].split()[0] == "Z")


def main(argv: list[str] | None = None) -> None:
    """Command line: wait for ``--url``, write ``--output``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", required=True, help="Base URL of the env server.")
    parser.add_argument("--output", required=True, type=Path, help="Env-config YAML to write.")
    parser.add_argument("--timeout", type=float, default=300.0, help="Seconds to wait for it.")
    parser.add_argument("--server-pid", type=int, help="Stop waiting once this process exits.")
    args = parser.parse_args(argv)
    url = args.url.rstrip("/")
    health = wait_for_health(url, args.timeout, args.server_pid)
    entries = remote_entries(url, health)
    args.output.write_text(yaml.safe_dump(entries, sort_keys=False))
    names = ", ".join(e["env_id"] for e in entries)
    print(f"env server {url} is ready ({names}); wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
