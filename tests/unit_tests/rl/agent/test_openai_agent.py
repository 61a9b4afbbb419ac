"""``agent_type: openai_agent`` in process: the example calculator agent (the ``openai`` client,
two tool rounds per episode) against the real engine on a tiny Hugging Face model behind the
real inference server; rollouts are exactly the engine's tokens, and failing agents never stall
the group."""

from __future__ import annotations

import asyncio

import pytest
from grpo_testing.hf_engine import load_hf_policy, running_engine

from examples.rl.environments.tool_agent import agent as tool_agent
from megatron.rl.agent.env_config import build_agents
from megatron.rl.agent.openai_agent import OpenAIAgentArgs, OpenAIAgentEnvironment
from megatron.rl.inference.interface import LocalInferenceInterface
from megatron.rl.server.http import EmbeddedServer
from megatron.rl.server.inference_server import create_inference_app
from megatron.rl.wire import GroupedRolloutRequest, SamplingParams

PROBLEMS = [{"id": "p0", "question": "What is 12+7?", "a": 12, "b": 7, "answer": 19}]
GROUP = 3
REQUEST = GroupedRolloutRequest(
    batch_id=0,
    index_in_batch=0,
    groups_in_batch=1,
    group_size=GROUP,
    seed=5,
    submission_policy_version=0,
    sampling=SamplingParams(temperature=1.0, max_tokens=6),
)


@pytest.fixture(scope="module")
def policy(tiny_hf_checkpoints):
    import torch.distributed as dist
    from grpo_testing.distributed import init_single_rank_world

    init_single_rank_world()
    try:
        yield load_hf_policy(tiny_hf_checkpoints["qwen2"])
    finally:
        dist.destroy_process_group()


def environment(agent_fn) -> OpenAIAgentEnvironment:
    args = OpenAIAgentArgs(
        agent="examples.rl.environments.tool_agent.agent:solve", problems=PROBLEMS, max_turns=3
    )
    env = OpenAIAgentEnvironment("calc", args)
    env.agent_fn = agent_fn
    return env


def run_group(policy, env: OpenAIAgentEnvironment):
    """The group's rollouts, generated through a served engine as the trainer does."""
    model, tokenizer = policy

    async def work():
        async with running_engine(model, tokenizer.vocab_size, tokenizer.eos_id, 4, 256) as engine:
            inference = LocalInferenceInterface(engine, tokenizer)
            server = await EmbeddedServer.start(
                create_inference_app(inference, tokenizer), "127.0.0.1", 0
            )
            inference.base_url = server.url
            try:
                engine.expect_group(0, 0, env.expected_requests(REQUEST))
                group = await asyncio.wait_for(env.group_rollout(REQUEST, inference), 60)
                engine.group_done(0, 0)
                return group
            finally:
                await server.stop()

    return asyncio.run(work())


def test_rollouts_are_the_engines_tokens_over_two_tool_rounds(policy):
    seen: dict[int, list] = {}

    def recording(task):
        from openai import OpenAI

        with OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0) as client:
            reward, completions = tool_agent.episode(client, task)
        seen[task.seed] = completions
        return reward

    env = environment(recording)
    group = run_group(policy, env)
    assert len(group.rollouts) == GROUP and len(seen) == GROUP
    for rollout in group.rollouts:
        assert rollout.error is None and rollout.reward in (0.0, 1.0)
        assert len(rollout.turn_lengths) == 3  # two tool rounds and the answer
        assert rollout.episode_metrics["turns"] == 3 and rollout.episode_metrics["truncated"] in (
            0,
            1,
        )
    by_tokens = {tuple(r.tokens): r for r in group.rollouts}
    for completions in seen.values():
        turns = [c.choices[0].model_extra for c in completions]
        last = turns[-1]
        rollout = by_tokens[tuple(last["prompt_token_ids"] + last["token_ids"])]
        mask, versions, position = rollout.generation_mask, [], 0
        for before, turn in zip([None, *turns], turns):
            if before is not None:  # each turn's prompt extends the previous turn token-exactly
                history = before["prompt_token_ids"] + before["token_ids"]
                assert turn["prompt_token_ids"][: len(history)] == history
            start = len(turn["prompt_token_ids"])
            assert not any(mask[position:start]) and all(
                mask[start : start + len(turn["token_ids"])]
            )
            position = start + len(turn["token_ids"])
            versions += turn["policy_versions"]
        assert position == len(rollout.tokens) and rollout.policy_versions == versions
        assert len(rollout.logprobs) == sum(mask)
    tool_text = tool_agent.add({"a": 12, "b": 7})
    assert all(tool_text in r.completion for r in group.rollouts)  # the tool results are in
    # The same group again: the same tokens (seeds and the schedule do not depend on timing).
    again = run_group(policy, environment(recording))
    assert [r.tokens for r in again.rollouts] == [r.tokens for r in group.rollouts]


def test_failing_and_misbehaving_agents_are_placeholders_and_do_not_stall_the_group(policy):
    refused: list[str] = []

    def agent(task):
        from openai import BadRequestError, OpenAI

        k = task.sample_index
        if k == 0:
            raise RuntimeError("the agent crashed before asking")
        with OpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0) as client:
            messages = [{"role": "user", "content": "hi"}]
            first = client.chat.completions.create(model=task.model, messages=messages)
            if k == 1:  # edits the model's answer: refused, the session ends
                messages += [
                    {"role": "assistant", "content": "edited"},
                    {"role": "user", "content": "?"},
                ]
                try:
                    client.chat.completions.create(model=task.model, messages=messages)
                except BadRequestError as exc:
                    refused.append(exc.response.json()["detail"])
                return 1.0
            return "not a number" if first else 0.0

    group = run_group(policy, environment(agent))
    crashed, edited, not_a_number = group.rollouts
    assert all(r.tokens == [] and r.reward == 0 for r in group.rollouts)
    assert "RuntimeError: the agent crashed before asking" in crashed.error
    assert "session failed" in edited.error and "'messages.1'" in edited.error
    assert len(refused) == 1 and "'messages.1'" in refused[0]  # what the agent was told
    assert "returned 'not a number', not a number" in not_a_number.error


def test_the_env_config_builds_it_and_names_a_bad_agent_or_problem_source(tmp_path):
    mix = build_agents(
        [
            {
                "agent_type": "openai_agent",
                "env_id": "calc",
                "agent_args": {
                    "agent": "examples.rl.environments.tool_agent.agent:solve",
                    "problems": PROBLEMS,
                },
            }
        ]
    )
    assert mix.requires_inference_server
    with pytest.raises(ValueError, match="exactly one of 'problems' and 'problems_file'"):
        OpenAIAgentArgs(agent="examples.rl.environments.tool_agent.agent:solve")
    with pytest.raises(ValueError, match="no function 'nope'"):
        OpenAIAgentArgs(agent="examples.rl.environments.tool_agent.agent:nope", problems=PROBLEMS)
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"id": 1}\n[1]\n')
    with pytest.raises(ValueError, match="line 2: not a JSON object"):
        OpenAIAgentArgs(
            agent="examples.rl.environments.tool_agent.agent:solve", problems_file=str(bad)
        )
