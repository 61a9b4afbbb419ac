"""``agent_type: reward_only``: Megatron-LM style environments over the real scheduler (fake
steps), in process and over HTTP; seeding, the two ``get_reward`` signatures, multi-turn hooks,
held-out prompts, config errors and the environment's failures."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from grpo_testing.fakes import FakeSteps

from megatron.rl.agent.env_config import EnvConfigError, build_agents
from megatron.rl.agent.reward_only import _PROMPT, RewardOnlyAdapter
from megatron.rl.http_client import ClientPool
from megatron.rl.inference.interface import LocalInferenceInterface
from megatron.rl.inference.remote import RemoteInferenceInterface
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.seeding import derive_seed
from megatron.rl.server.inference_server import create_inference_app
from megatron.rl.tokenizer import CharTokenizer
from megatron.rl.wire import GroupedRolloutRequest

TOK = CharTokenizer()
SEED = 5


def adapter(env_class: str, **agent_args) -> RewardOnlyAdapter:
    entry = {
        "agent_type": "reward_only",
        "env_id": "env",
        "agent_args": {
            "env_class": f"grpo_testing.megatron_lm_style:{env_class}",
            "max_tokens": 3,
            **agent_args,
        },
    }
    return build_agents([entry]).agents[0]


def request(batch_id: int = 2, index: int = 1, eval_prompts: int | None = None):
    return GroupedRolloutRequest(
        batch_id=batch_id,
        index_in_batch=index,
        groups_in_batch=4,
        group_size=4,
        seed=SEED,
        submission_policy_version=1,
        eval_prompts=eval_prompts,
    )


def run_groups(agent: RewardOnlyAdapter, requests: list, remote: bool = False):
    """Groups of ``requests`` run one after another on a fresh engine (or over HTTP to it)."""

    async def run():
        engine = ContinuousBatchingScheduler(
            FakeSteps(),
            SchedulerConfig(max_requests=8, max_seq_len=32, barrier_timeout_s=5),
            lambda: 1,
        )
        engine.start()
        engine.resume()
        local = LocalInferenceInterface(engine, TOK)
        pool = ClientPool(
            8, httpx.Timeout(5.0), httpx.ASGITransport(create_inference_app(local, TOK))
        )
        inference = RemoteInferenceInterface("http://t", pool) if remote else local
        groups = []
        try:
            for r in requests:
                engine.expect_group(r.batch_id, r.index_in_batch, agent.expected_requests(r))
                groups.append(await asyncio.wait_for(agent.group_rollout(r, inference), 10))
                engine.group_done(r.batch_id, r.index_in_batch)
            return groups
        finally:
            await pool.aclose()
            await engine.aclose()

    return asyncio.run(run())


def test_prompts_come_from_get_prompt_seeded_by_the_group_and_leave_random_untouched():
    agent = adapter("CopyDigits")
    random.seed(123)
    before = random.getstate()
    (group,) = run_groups(agent, [request()])
    assert random.getstate() == before
    random.seed(derive_seed(SEED, 2, 1, _PROMPT))
    digits = "".join(random.choice("0123456789") for _ in range(random.randint(1, 3)))
    assert {r.prompt for r in group.rollouts} == {digits + "="}
    assert {r.problem_id for r in group.rollouts} == {digits}
    assert agent.environment.calls[0] == ("get_prompt", False)
    rewards = [c for c in agent.environment.calls if c[0] == "get_reward"]
    assert [(c[1], c[2]) for c in rewards] == [(r.completion, "length") for r in group.rollouts]
    assert [r.reward for r in group.rollouts] == [
        sum(a == b for a, b in zip(digits, r.completion)) / max(len(digits), len(r.completion))
        for r in group.rollouts
    ]


def test_the_same_groups_in_another_order_or_over_http_are_identical():
    requests = [request(b, i) for b in (0, 1) for i in (0, 3)]
    forward = run_groups(adapter("CopyDigits"), requests)
    backward = run_groups(adapter("CopyDigits"), requests[::-1])[::-1]
    assert forward == backward == run_groups(adapter("CopyDigits"), requests, remote=True)
    assert len({g.rollouts[0].prompt for g in forward}) > 1


def test_the_older_two_argument_get_reward_and_plain_methods_work():
    (group,) = run_groups(adapter("OldSignature", max_tokens=2), [request()])
    assert all(r.prompt == "12=" and r.reward in (0.0, 1.0) and not r.error for r in group.rollouts)


def test_multi_turn_hooks_see_megatron_lm_responses_and_conversations():
    agent = adapter("Higher")
    assert agent.max_turns == 3  # the class's max_turns attribute
    (group,) = run_groups(agent, [request()])
    env = agent.environment
    assert sorted(len(d) for d in env.dialogues) == sorted(
        2 * int(r.reward) for r in group.rollouts
    )  # user prompt, then (assistant, user) per continued turn, then the last assistant turn
    prompt = group.rollouts[0].prompt
    for turn_idx, content, conversation in env.observed:
        assert conversation[0] == ("user", prompt)
        assert len(conversation) == 1 + 2 * turn_idx
        assert all(role == "user" for role, _ in conversation[2::2])
    for rollout in group.rollouts:
        assert sum(rollout.generation_mask) == 3 * int(rollout.reward)


def test_continuing_without_an_observation_masks_the_rollout():
    (group,) = run_groups(adapter("SilentObservation"), [request()])
    assert all(r.is_placeholder and "done=False with None" in r.error for r in group.rollouts)


def test_held_out_requests_use_evaluation_prompts_when_defined():
    held_out = run_groups(adapter("CopyWithHeldOutSet"), [request(3, 0, eval_prompts=8)])
    assert held_out[0].rollouts[0].prompt == "33="
    agent = adapter("CopyDigits")
    (group,) = run_groups(agent, [request(3, 0, eval_prompts=8)])
    assert group.rollouts[0].prompt.endswith(":")  # get_prompt(validation=True)
    assert agent.environment.calls[0] == ("get_prompt", True)
    (short,) = run_groups(adapter("CopyWithHeldOutSet"), [request(9, 0, eval_prompts=8)])
    assert all(r.is_placeholder and "returned 8 prompts" in r.error for r in short.rollouts)


def test_a_failing_prompt_source_masks_the_group():
    (group,) = run_groups(adapter("BrokenPrompt"), [request()])
    assert all(r.is_placeholder and "dataset shard missing" in r.error for r in group.rollouts)


@pytest.mark.parametrize(
    "agent_args, needle",
    [
        pytest.param({"env_class": "no/such/file.py:X"}, "no such file", id="missing-file"),
        pytest.param({"env_class": "grpo_testing.megatron_lm_style:Nope"}, "no class", id="class"),
        pytest.param({"env_class": "grpo_testing.nosuch:X"}, "cannot import", id="module"),
        pytest.param({"env_class": "CopyDigits"}, "package.module:Class", id="not-a-spec"),
        pytest.param(
            {
                "env_class": "grpo_testing.megatron_lm_style:NeedsArgument",
                "env_args": {"path": "p"},
            },
            "FileNotFoundError",
            id="constructor-raises",
        ),
        pytest.param(
            {"env_class": "grpo_testing.megatron_lm_style:CopyDigits", "env_args": {"bad": 1}},
            "unexpected keyword",
            id="unknown-constructor-argument",
        ),
        pytest.param(
            {"env_class": "grpo_testing.fakes:SeededInference"},
            "get_prompt",
            id="not-an-env",
        ),
        pytest.param(
            {"env_class": "grpo_testing.megatron_lm_style:CopyDigits", "max_turns": 2},
            "get_observation",
            id="multi-turn-without-observations",
        ),
        pytest.param({}, "agent_args.env_class", id="no-class"),
    ],
)
def test_config_errors_name_the_entry_and_the_problem(agent_args, needle):
    with pytest.raises(EnvConfigError) as info:
        build_agents([{"agent_type": "reward_only", "agent_args": agent_args}], "envs.yaml")
    message = str(info.value)
    assert "envs.yaml, entry 0" in message and "agent_args" in message and needle in message
