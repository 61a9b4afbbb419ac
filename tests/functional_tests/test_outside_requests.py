"""Requests from outside training at the trainer's endpoint, end to end
(``tools/benchmarks/outside_requests.py`` at a few steps): a remote environment behind a real env
server, the job's key set, an ``openai`` client sending /v1/completions and /v1/chat/completions
while the trainer trains at forced lag 2 under the deterministic schedule."""

from __future__ import annotations

import pytest

from tools.benchmarks.outside_requests import measure


@pytest.mark.slow  # two training runs of 24 steps: about a minute on 2 cores
def test_outside_requests_are_answered_in_a_few_engine_steps_and_leave_the_run_bitwise_equal(
    tmp_path,
):
    result = measure(tmp_path, steps=24, outside_slots=None)
    assert result["steps"] == 24
    assert result["endpoint_key_source"].startswith("--rl-api-key-file ")
    assert result["models"] == ["policy"]  # GET /v1/models through the client, with the key
    routes = [r["route"] for r in result["requests"]]
    assert "completions" in routes and "chat" in routes, routes
    # 4 tokens each: one engine step per token, none spent waiting for a slot or the barrier.
    assert {r["engine_steps"] for r in result["requests"]} == {4}, result["requests"]
    assert result["metrics_bitwise_equal"]
