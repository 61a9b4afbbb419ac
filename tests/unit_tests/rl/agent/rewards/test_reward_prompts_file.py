"""Prompts from a file scored by reward functions alone: an entry with ``prompts_file`` needs
``reward_funcs`` and has no environment reward; a bad line is named; chat prompts."""

from __future__ import annotations

import json

import pytest
from test_reward_functions import request, run

from megatron.rl.agent.env_config import EnvConfigError, build_agents


def test_a_prompts_file_needs_reward_funcs_and_has_no_environment_reward(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "12=", "reference": "12"}\n{"prompt": "7=", "reference": 7}\n')
    prompts = {"agent_type": "prompts", "env_id": "p", "agent_args": {"path": str(path)}}
    with pytest.raises(
        EnvConfigError, match="field 'reward_funcs': agent_type 'prompts' has no reward"
    ):
        build_agents([prompts])
    with pytest.raises(EnvConfigError, match="'environment' is the environment's own reward"):
        build_agents([{**prompts, "reward_funcs": [{"function": "environment"}]}])
    config = [{**prompts, "reward_funcs": [{"function": "exact_match"}]}]
    groups = run(config, [request(0, i, 8) for i in range(4)])
    references = {g.rollouts[0].problem_id: g.rollouts[0].prompt[:-1] for g in groups}
    assert set(references) <= {"prompts.jsonl:1", "prompts.jsonl:2"}
    for rollout in (r for g in groups for r in g.rollouts):
        assert rollout.reward == float(rollout.completion == rollout.prompt[:-1])


@pytest.mark.parametrize(
    "line, message",
    [
        pytest.param(
            '{"question": "1"}',
            "prompts.jsonl:1: field 'prompt' must be a non-empty "
            "string or a list of {role, content} messages, got None",
            id="no-prompt",
        ),
        pytest.param(
            '{"prompt": [{"role": "robot", "content": "x"}]}',
            "prompts.jsonl:1: field 'prompt'",
            id="bad-message",
        ),
        pytest.param("not json", "prompts.jsonl:1: invalid JSON", id="not-json"),
    ],
)
def test_a_bad_prompts_file_names_its_line(tmp_path, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(line + "\n")
    config = {
        "agent_type": "prompts",
        "agent_args": {"path": str(path)},
        "reward_funcs": [{"function": "exact_match"}],
    }
    with pytest.raises(EnvConfigError) as info:
        build_agents([config])
    assert "field 'agent_args.path'" in str(info.value) and message in str(info.value)


def test_chat_prompts_from_a_file(tmp_path):
    path = tmp_path / "chat.jsonl"
    rows = [
        {"q": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
        {"q": "Say 1", "id": "one"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = {"path": str(path), "prompt_field": "q", "id_field": "id"}
    config = {
        "agent_type": "prompts",
        "agent_args": args,
        "reward_funcs": [{"function": "exact_match"}],
    }
    with pytest.raises(EnvConfigError, match=r"chat.jsonl:1: no field 'id'"):
        build_agents([config])
    args.pop("id_field")
    chat = {**args, "prompt_style": "chat", "system_prompt": "S", "prompt_template": "<{prompt}>"}
    (agent,) = build_agents([{**config, "agent_args": chat}]).agents
    first, second = agent.problem(0), agent.problem(1)
    assert [(m.role, m.content) for m in first.messages] == [
        ("system", "Be brief."),
        ("user", "Hi"),
    ]
    assert [(m.role, m.content) for m in second.messages] == [("system", "S"), ("user", "<Say 1>")]
    assert (first.problem_id, second.problem_id) == ("chat.jsonl:1", "chat.jsonl:2")
