"""``agent_type: remote`` against a real env server on loopback (uvicorn in the test's loop)."""

from __future__ import annotations

import asyncio
import time

import pytest
from grpo_testing.fakes import SeededInference

from megatron.rl.agent.env_config import EnvConfigError, build_agents
from megatron.rl.agent.remote import (
    RemoteAgent,
    RemoteAgentArgs,
    RemoteEnvironmentError,
)
from megatron.rl.server.env_server import create_app
from megatron.rl.server.http import EmbeddedServer
from megatron.rl.server.inference_server import create_inference_app
from megatron.rl.wire import GroupedRolloutRequest

SERVER_ENVS = [{"agent_type": "digits", "env_id": "copy", "agent_args": {"task": "copy"}}]


def request(index: int = 0) -> GroupedRolloutRequest:
    return GroupedRolloutRequest(
        batch_id=2,
        index_in_batch=index,
        groups_in_batch=4,
        group_size=4,
        seed=5,
        submission_policy_version=1,
    )


async def start_servers(inference: SeededInference):
    """Env server + a stand-in for the trainer's inference server, both on free ports."""
    env = await EmbeddedServer.start(create_app(build_agents(SERVER_ENVS)), "127.0.0.1", 0)
    trainer = await EmbeddedServer.start(
        create_inference_app(inference, inference.tokenizer), "127.0.0.1", 0
    )
    inference.base_url = trainer.url
    return env, trainer


def remote_agent(url: str, **overrides) -> RemoteAgent:
    args = {"url": url, "env_id": "copy", "max_retries": 1, "backoff_s": 0.01, **overrides}
    return RemoteAgent("remote", RemoteAgentArgs(**args))


def test_remote_group_equals_the_in_process_group():
    async def run():
        inference = SeededInference()
        env, trainer = await start_servers(inference)
        agent = remote_agent(env.url)
        await agent.astart()
        try:
            remote = [await agent.group_rollout(request(i), inference) for i in range(3)]
        finally:
            await agent.aclose()
            await env.stop()
            await trainer.stop()
        local_agent = build_agents(SERVER_ENVS).agents[0]
        local = [await local_agent.group_rollout(request(i), SeededInference()) for i in range(3)]
        return remote, local

    remote, local = asyncio.run(run())
    assert remote == local


def test_astart_rejects_an_env_id_the_server_does_not_host():
    async def run():
        env, trainer = await start_servers(SeededInference())
        agent = remote_agent(env.url, env_id="sort")
        try:
            await agent.astart()
        finally:
            await agent.aclose()
            await env.stop()
            await trainer.stop()

    with pytest.raises(RemoteEnvironmentError, match=r"does not host env_id 'sort'.*\['copy'\]"):
        asyncio.run(run())


def test_unreachable_server_fails_fast_naming_it():
    async def run():
        agent = remote_agent("http://127.0.0.1:9")
        try:
            await agent.astart()
        finally:
            await agent.aclose()

    start = time.monotonic()
    with pytest.raises(RemoteEnvironmentError, match=r"env server http://127.0.0.1:9 \(remote\)"):
        asyncio.run(run())
    assert time.monotonic() - start < 10


def test_server_dying_mid_run_raises_naming_the_server():
    async def run():
        inference = SeededInference()
        env, trainer = await start_servers(inference)
        agent = remote_agent(env.url)
        await agent.astart()
        await agent.group_rollout(request(0), inference)
        await env.stop()
        try:
            await agent.group_rollout(request(1), inference)
        finally:
            await agent.aclose()
            await trainer.stop()

    with pytest.raises(RemoteEnvironmentError, match="env server http://127.0.0.1:[0-9]+ .*after"):
        asyncio.run(run())


def test_group_without_trainer_inference_server_is_an_error():
    async def run():
        env, trainer = await start_servers(SeededInference())
        agent = remote_agent(env.url)
        await agent.astart()
        try:
            await agent.group_rollout(request(), SeededInference())  # base_url is None
        finally:
            await agent.aclose()
            await env.stop()
            await trainer.stop()

    with pytest.raises(RemoteEnvironmentError, match="inference server is not running"):
        asyncio.run(run())


@pytest.mark.parametrize("single_turn, expected", [(True, 4), (False, None)])
def test_announced_requests_follow_single_turn(single_turn, expected):
    agent = remote_agent("http://127.0.0.1:9", single_turn=single_turn)
    assert agent.expected_requests(request()) == expected
    assert agent.requires_inference_server


def test_env_config_validates_remote_args_by_field():
    entries = [{"agent_type": "remote", "agent_args": {"url": "localhost:8000"}}]
    with pytest.raises(EnvConfigError, match=r"entry 0 \(agent_type 'remote'\).*agent_args.url"):
        build_agents(entries, "envs.yaml")
    mix = build_agents([{"agent_type": "remote", "agent_args": {"url": "http://h:1"}}])
    assert mix.requires_inference_server
