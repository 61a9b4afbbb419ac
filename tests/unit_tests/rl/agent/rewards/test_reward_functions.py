"""Several reward functions per environment with weights (``reward_funcs``): built-ins, user code
(TRL's calling convention), the weighted sum and each function's value on the rollout, the fault
policy for functions that fail, the env-config errors, the env server, and the wire format
(prompts files: ``test_reward_prompts_file.py``)."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest
from grpo_testing import rewards as user
from grpo_testing.fakes import SeededInference

from megatron.rl.agent.env_config import EnvConfigError, build_agents
from megatron.rl.rollout.faults import EnvironmentFailures, FailureBudget, FaultLog, run_group
from megatron.rl.server.env_server import create_app
from megatron.rl.server.inference_server import create_inference_app
from megatron.rl.wire import GroupedRolloutCall, GroupedRolloutRequest, RolloutGroup, TokenRollout

DIGITS = {"agent_type": "digits", "env_id": "copy", "agent_args": {"task": "copy"}}


def request(batch_id: int = 0, index: int = 0, group_size: int = 6) -> GroupedRolloutRequest:
    return GroupedRolloutRequest(
        batch_id=batch_id,
        index_in_batch=index,
        groups_in_batch=4,
        group_size=group_size,
        seed=7,
        submission_policy_version=2,
    )


def entry(*funcs: dict, base: dict = DIGITS) -> dict:
    return {**base, "reward_funcs": list(funcs)}


def run(config: list[dict], requests: list[GroupedRolloutRequest]) -> list[RolloutGroup]:
    """The groups of ``requests`` from the first environment of ``config`` (started, closed)."""
    agent = build_agents(config).agents[0]

    async def go():
        await agent.astart()
        try:
            return [await agent.group_rollout(r, SeededInference()) for r in requests]
        finally:
            await agent.aclose()

    return asyncio.run(go())


def plain_rewards(requests: list[GroupedRolloutRequest]) -> list[list[float]]:
    return [[r.reward for r in g.rollouts] for g in run([DIGITS], requests)]


def test_the_reward_is_the_weighted_sum_and_each_value_is_kept_by_name():
    requests = [request(b, i) for b in range(2) for i in range(2)]
    config = [
        entry(
            {"function": "environment", "weight": 2.0},
            {"function": "regex", "weight": 0.5, "args": {"pattern": "^[0-9]{2}$"}},
            {"function": "grpo_testing.rewards:digit_count", "weight": -0.25},
        )
    ]
    own = plain_rewards(requests)
    for group, env_rewards in zip(run(config, requests), own):
        for rollout, env_reward in zip(group.rollouts, env_rewards):
            assert rollout.error is None
            c = rollout.reward_components
            assert list(c) == ["environment", "regex", "digit_count"]
            assert c["environment"] == env_reward  # the digit task's own reward
            assert c["regex"] == float(len(rollout.completion) == 2)
            assert c["digit_count"] == len(rollout.completion)
            expected = 2.0 * c["environment"] + 0.5 * c["regex"] - 0.25 * c["digit_count"]
            assert rollout.reward == pytest.approx(expected, abs=1e-12)


def test_builtins_exact_match_and_soft_overlong_punishment():
    """SeededInference answers 1-3 digits plus EOS: 2-4 generated tokens. With a budget of 3 and
    a soft interval of 2: 2 tokens -> -0.5, 3 -> -1.0, 4 -> -1 (beyond the budget)."""
    config = [
        entry(
            {"function": "exact_match", "name": "exact"},
            {
                "function": "soft_overlong_punishment",
                "args": {"max_completion_tokens": 3, "soft_punish_tokens": 2},
            },
        )
    ]
    (group,) = run(config, [request(index=1, group_size=12)])
    (own,) = plain_rewards([request(index=1, group_size=12)])
    penalty = {2: -0.5, 3: -1.0, 4: -1.0}
    for rollout, env_reward in zip(group.rollouts, own):
        c = rollout.reward_components
        assert c["exact"] == float(env_reward == 1.0)  # the copy task's reward 1 = exact copy
        assert c["soft_overlong_punishment"] == penalty[len(rollout.completion) + 1]
    assert {len(r.completion) for r in group.rollouts} == {1, 2, 3}


def test_user_functions_get_trl_style_keyword_lists_and_their_args():
    user.CALLS.clear()
    config = [
        entry(
            {"function": "grpo_testing.rewards:recording", "args": {"scale": 0.5}},
            {"function": "grpo_testing.rewards:async_first_digit", "name": "first"},
        )
    ]
    (group,) = run(config, [request(group_size=3)])
    (call,) = user.CALLS  # once per group
    problem_prompt = call["prompts"][0]
    assert call["prompts"] == [problem_prompt] * 3 and problem_prompt.endswith("=")
    assert call["completions"] == [r.completion for r in group.rollouts]
    assert call["references"] == [problem_prompt[:-1]] * 3  # the copy task's answer
    assert call["completion_tokens"] == [len(r.completion) + 1 for r in group.rollouts]  # + EOS
    assert call["scale"] == 0.5
    for rollout in group.rollouts:
        assert rollout.reward_components == {
            "recording": 0.5 * (len(rollout.completion) + 1),
            "first": float(rollout.completion[0]),
        }


def test_none_means_the_function_does_not_apply():
    config = [
        entry(
            {"function": "grpo_testing.rewards:none_for_short", "weight": 3.0},
            {"function": "grpo_testing.rewards:digit_count"},
        )
    ]
    (group,) = run(config, [request(group_size=12)])
    for rollout in group.rollouts:
        if len(rollout.completion) < 2:
            assert rollout.reward_components == {"digit_count": 1.0} and rollout.reward == 1.0
        else:
            n = len(rollout.completion)
            assert rollout.reward_components == {"none_for_short": 1.0, "digit_count": n}
            assert rollout.reward == 3.0 + n


@pytest.mark.parametrize(
    "function, failed, error",
    [
        pytest.param(
            "raising",
            lambda c: True,
            "reward function 'raising': RuntimeError: the scorer's service is down",
            id="raises-for-the-group",
        ),
        pytest.param(
            "nan_for_two",
            lambda c: len(c) == 2,
            "reward function 'nan_for_two': the value is not finite: nan",
            id="non-finite",
        ),
        pytest.param(
            "wrong_length",
            lambda c: True,
            "reward function 'wrong_length': ValueError: grpo_testing.rewards:wrong_length "
            "returned 1 values for 12",
            id="wrong-length",
        ),
        pytest.param(
            "always_none",
            lambda c: True,
            "reward functions ['always_none']: every one returned None",
            id="all-none",
        ),
    ],
)
def test_a_failing_function_makes_placeholders_naming_it(function, failed, error):
    config = [{**DIGITS, "reward_funcs": [{"function": f"grpo_testing.rewards:{function}"}]}]
    (group,) = run(config, [request(group_size=12)])
    (plain,) = run([DIGITS], [request(group_size=12)])  # the same completions, scored as usual
    completions = [r.completion for r in plain.rollouts]
    assert any(failed(c) for c in completions)
    for rollout, completion in zip(group.rollouts, completions):
        assert rollout.is_placeholder == failed(completion)
        if rollout.is_placeholder:
            assert rollout.error == error
            assert rollout.reward == 0.0 and rollout.reward_components is None


def test_failing_functions_follow_the_fault_policy_and_its_budget():
    agent = build_agents(
        [
            {
                **DIGITS,
                "env_id": "shaped",
                "reward_funcs": [{"function": "grpo_testing.rewards:raising"}],
            }
        ]
    )
    faults = FaultLog()
    groups = [
        asyncio.run(run_group(agent, request(0, i), SeededInference(), faults)) for i in range(4)
    ]
    assert all(r.is_placeholder for g in groups for r in g.rollouts)
    assert faults.first_error["shaped"].startswith("reward function 'raising': RuntimeError")
    with pytest.raises(EnvironmentFailures, match="every rollout of batch 0 failed"):
        FailureBudget(max_fraction=0.5, min_rollouts=8).check(0, groups, faults)


def test_some_failed_rollouts_count_against_the_failed_share():
    """Two-digit completions get NaN: masked, counted; over the limit the run stops naming the
    environment and the function's error; under it the run trains on."""
    config = [
        {
            **DIGITS,
            "env_id": "shaped",
            "reward_funcs": [{"function": "grpo_testing.rewards:nan_for_two"}],
        }
    ]
    agent, faults = build_agents(config), FaultLog()
    groups = [
        asyncio.run(run_group(agent, request(0, i, 8), SeededInference(), faults)) for i in range(4)
    ]
    failed = sum(r.is_placeholder for g in groups for r in g.rollouts)
    assert 0 < failed < 32
    FailureBudget(max_fraction=0.9, min_rollouts=32).check(0, groups, faults)  # trains on
    with pytest.raises(EnvironmentFailures) as info:
        FailureBudget(max_fraction=0.05, min_rollouts=32).check(0, groups, faults)
    assert str(info.value).startswith(f"environment 'shaped': {failed} of its 32 rollouts so far")
    assert str(info.value).endswith("reward function 'nan_for_two': the value is not finite: nan")


@pytest.mark.parametrize(
    "funcs, message",
    [
        pytest.param(
            [{"function": "nope"}],
            "field 'reward_funcs.0.function': unknown reward function 'nope' (built-ins: "
            "environment, exact_match, regex, soft_overlong_punishment, reward_model, llm_judge; "
            "or 'package.module:function')",
            id="unknown",
        ),
        pytest.param(
            [{"function": "environment"}, {"function": "regex", "args": {"pattern": "("}}],
            "field 'reward_funcs.1.args.pattern': Value error, not a regular expression",
            id="bad-args",
        ),
        pytest.param(
            [{"function": "regex", "args": {"patern": "x"}}],
            "field 'reward_funcs.0.args.pattern': Field required; "
            "field 'reward_funcs.0.args.patern': Extra inputs are not permitted",
            id="misspelled-arg",
        ),
        pytest.param(
            [{"function": "environment"}, {"function": "exact_match", "name": "environment"}],
            "field 'reward_funcs.1.name': 'environment' is the name of reward_funcs.0 too",
            id="same-name",
        ),
        pytest.param(
            [{"function": "environment", "weight": float("inf")}],
            "field 'reward_funcs.0.weight': Input should be a finite number",
            id="infinite-weight",
        ),
        pytest.param(
            [{"function": "grpo_testing.rewards:needs_secret"}],
            "field 'reward_funcs.0.function': grpo_testing.rewards:needs_secret requires "
            "['secret'], which is neither a keyword it is called with",
            id="unknown-parameter",
        ),
        pytest.param(
            [{"function": "grpo_testing.rewards:no_such_function"}],
            "field 'reward_funcs.0.function': 'grpo_testing.rewards' has no function "
            "'no_such_function'",
            id="missing-function",
        ),
        pytest.param(
            [{"function": "environment", "args": {"x": 1}}],
            "field 'reward_funcs.0.args': 'environment' takes no args",
            id="environment-args",
        ),
        pytest.param([], "field 'reward_funcs': List should have at least 1 item", id="empty"),
    ],
)
def test_config_errors_name_the_entry_and_the_field(funcs, message):
    with pytest.raises(EnvConfigError) as info:
        build_agents([entry(*funcs)])
    assert str(info.value).startswith("env config <default>, entry 0")
    assert message in str(info.value)


def test_reward_funcs_need_a_single_turn_environment():
    guess = {
        "agent_type": "examples.rl.environments.guess:GuessEnvironment",
        "reward_funcs": [{"function": "regex", "args": {"pattern": "x"}}],
    }
    remote = {
        "agent_type": "remote",
        "agent_args": {"url": "http://127.0.0.1:9"},
        "reward_funcs": [{"function": "environment"}],
    }
    for config, name in ((guess, "GuessEnvironment"), (remote, "RemoteAgent")):
        with pytest.raises(
            EnvConfigError, match=f"field 'reward_funcs': needs a single-turn .*{name}"
        ):
            build_agents([config])


def test_the_env_server_returns_what_the_in_process_environment_does():
    config = [
        entry(
            {"function": "environment"},
            {"function": "grpo_testing.rewards:async_first_digit", "weight": 0.1},
        )
    ]
    calls = [
        GroupedRolloutCall(request=request(b, i), inference_url="http://trainer:9", env_id="copy")
        for b in range(2)
        for i in range(3)
    ]
    inference = SeededInference()
    app = create_app(
        build_agents(config),
        transport=httpx.ASGITransport(create_inference_app(inference, inference.tokenizer)),
    )

    async def serve():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app)
            async with httpx.AsyncClient(transport=transport, base_url="http://env") as client:
                return [
                    await client.post("/v1/grouped_rollouts", json=c.model_dump(mode="json"))
                    for c in calls
                ]

    answers = asyncio.run(serve())
    assert [a.status_code for a in answers] == [200] * len(calls)
    remote = [RolloutGroup.model_validate(a.json()) for a in answers]
    assert remote == run(config, [c.request for c in calls])
    assert all(
        set(r.reward_components) == {"environment", "async_first_digit"}
        for g in remote
        for r in g.rollouts
    )


def test_the_wire_format_is_unchanged_without_reward_functions():
    (group,) = run([DIGITS], [request()])
    payload = json.loads(group.model_dump_json())
    assert all("reward_components" not in r for r in payload["rollouts"])
    (shaped,) = run([entry({"function": "environment"})], [request()])
    payload = json.loads(shaped.model_dump_json())
    assert all(r["reward_components"] == {"environment": r["reward"]} for r in payload["rollouts"])
    assert RolloutGroup.model_validate(payload) == shaped
    rollout = payload["rollouts"][0]
    rollout.pop("reward_components")  # what an env server from before the field sends
    assert TokenRollout.model_validate(rollout).reward_components is None
    with pytest.raises(ValueError, match="finite"):
        TokenRollout.model_validate({**rollout, "reward_components": {"x": math.inf}})


def test_evaluation_records_carry_each_function_s_value():
    from megatron.rl.eval.runner import eval_record

    (shaped,) = run([entry({"function": "environment"})], [request()])
    (plain,) = run([DIGITS], [request()])
    record = eval_record("copy", "greedy", shaped, 0, (1,))
    assert record["reward_components"] == {"environment": record["reward"]}
    assert "reward_components" not in eval_record("copy", "greedy", plain, 0, (1,))


def test_arrays_are_values_and_a_zero_weight_is_only_logged():
    config = [
        entry(
            {"function": "grpo_testing.rewards:numpy_lengths", "weight": 0.0},
            {"function": "environment"},
        )
    ]
    (group,) = run(config, [request(group_size=6)])
    for r in group.rollouts:
        assert r.reward_components["numpy_lengths"] == len(r.completion)
        assert r.reward == r.reward_components["environment"]
