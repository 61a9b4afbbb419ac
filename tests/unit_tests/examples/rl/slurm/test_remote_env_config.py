"""``examples/rl/slurm/remote_env_config.py``: the remote env config written from ``/health``."""

from __future__ import annotations

from examples.rl.slurm.remote_env_config import remote_entries


def test_one_remote_entry_per_trained_environment_and_none_for_evaluation_only_ones():
    health = {
        "status": "ok",
        "environments": [
            {"env_id": "copy", "agent_type": "DigitTaskEnvironment", "weight": 2.0},
            {"env_id": "sort", "agent_type": "DigitTaskEnvironment", "weight": 0.0},
        ],
    }
    assert remote_entries("http://n2:8000", health) == [
        {
            "agent_type": "remote",
            "env_id": "copy",
            "agent_args": {"url": "http://n2:8000", "env_id": "copy"},
            "weight": 2.0,
        }
    ]
