"""The arithmetic environment: its fixed problem list and held-out split, chat prompts, the
reward rule case by case, and start-up errors naming the field."""

from __future__ import annotations

import random

import pytest

from examples.rl.environments.arithmetic import (
    ArithmeticArgs,
    ArithmeticEnvironment,
    arithmetic_reward,
    generate_problems,
)
from megatron.rl.agent.api import Problem
from megatron.rl.agent.dataset import split_indices
from megatron.rl.agent.env_config import EnvConfigError, build_agents
from megatron.rl.seeding import derive_seed
from megatron.rl.wire import GroupedRolloutRequest

AGENT_TYPE = "examples.rl.environments.arithmetic:ArithmeticEnvironment"
SUFFIX = " Put the final answer within \\boxed{}."


def env(**args) -> ArithmeticEnvironment:
    return ArithmeticEnvironment("arithmetic", ArithmeticArgs(**args))


def request(batch: int, seed: int = 7, eval_prompts: int | None = None) -> GroupedRolloutRequest:
    return GroupedRolloutRequest(
        batch_id=batch,
        index_in_batch=0,
        groups_in_batch=1,
        group_size=4,
        seed=seed,
        submission_policy_version=0,
        eval_prompts=eval_prompts,
    )


def test_the_problems_are_the_generator_list_of_the_arguments():
    arithmetic = env(num_problems=300, dataset_seed=4, operations=["multiply", "add"])
    expected = generate_problems(300, 4, ("multiply", "add"), 20, 9)
    assert arithmetic.num_problems() == 300
    for index in (0, 150, 299):
        problem = arithmetic.problem(index)
        assert problem.problem_id == f"arithmetic-4:{index}"
        assert problem.messages[-1].content == expected[index].question + SUFFIX
        assert problem.answer == str(expected[index].answer)


def test_the_held_out_split_is_disjoint_stable_and_evaluated_once_each():
    first, again = env(), env()
    first.hold_out(0.1)
    again.hold_out(0.1)
    validation, training = first.validation_indices, first.training_indices
    assert (validation, training) == split_indices(2000, 0.1)[::-1]
    assert len(validation) == 200 and not set(validation) & set(training)
    assert sorted(validation + training) == list(range(2000))
    held_out = [first.problem(i) for i in validation]
    assert held_out == [again.problem(i) for i in again.validation_indices]
    evaluated = [first.problem_for(request(b, eval_prompts=200)) for b in range(200)]
    assert evaluated == held_out  # in split order, each once, whatever the run seed
    held_questions = {p.messages[-1].content for p in held_out}
    for batch in range(300):  # training draws (any run seed) never give a held-out question
        drawn = first.problem_for(request(batch, seed=batch * 31))
        assert drawn.messages[-1].content not in held_questions


def test_training_draws_are_reproducible_from_the_request():
    seeds = [derive_seed(1234, b, 0) for b in range(50)]
    first = [env().make_problem(random.Random(s)) for s in seeds]
    assert first == [env().make_problem(random.Random(s)) for s in seeds]
    assert len({p.problem_id for p in first}) > 40


def test_chat_prompt_with_and_without_a_system_message():
    default = env().problem(0)
    assert default.prompt is None and default.max_tokens == 64
    assert [m.role for m in default.messages] == ["user"]
    assert default.messages[0].content.endswith("?" + SUFFIX)
    custom = env(system_prompt="Answer briefly.", prompt_suffix="", max_tokens=32).problem(0)
    assert [(m.role, m.content) for m in custom.messages] == [
        ("system", "Answer briefly."),
        ("user", generate_problems(2000, 0)[0].question),
    ]
    assert custom.max_tokens == 32


@pytest.mark.parametrize(
    "completion, reward",
    [
        pytest.param("5 + 7 = 12. \\boxed{12}", 1.0, id="right-boxed"),
        pytest.param("Anna has 5 + 7 = 12 apples.", 1.0, id="right-last-number"),
        pytest.param("#### 12", 1.0, id="right-hashes"),
        pytest.param("\\boxed{12.0}", 1.0, id="equal-spelling"),
        pytest.param("The final answer is 12.\n\nThe answer is: 12", 1.0, id="ramble-right"),
        pytest.param("\\boxed{13}", 0.0, id="wrong-boxed"),
        pytest.param("5 + 7 = 13", 0.0, id="wrong-last-number"),
        pytest.param("\\boxed{}", 0.0, id="empty-box"),
        pytest.param("\\boxed{ }", 0.0, id="blank-box"),
        pytest.param("The answer is 12.\n\nNext, 3 more is 15", 0.0, id="ramble-ends-wrong"),
        pytest.param("5 + 7 = 1", 0.0, id="cut-off-by-the-budget"),
        pytest.param("\\boxed{} = 5 + 7 = 12", 1.0, id="empty-box-then-right-number"),
        pytest.param("12 apples. The answer is \\boxed{}.", 1.0, id="right-then-copied-empty-box"),
        pytest.param("\\boxed{12} and 3 more is 15", 1.0, id="box-wins-over-later-numbers"),
        pytest.param("12 in all, so \\boxed{15}", 0.0, id="wrong-box-wins"),
        pytest.param("twelve", 0.0, id="words"),
        pytest.param("", 0.0, id="nothing"),
    ],
)
def test_reward(completion, reward):
    """1 for a verified answer, 0 otherwise: no format reward (module docstring)."""
    problem = Problem("arithmetic-0:0", None, "12", messages=[{"role": "user", "content": "?"}])
    assert env().reward(problem, completion) == arithmetic_reward("12", completion) == reward


@pytest.mark.parametrize(
    "agent_args, field, message",
    [
        pytest.param({"operations": ["add", "add"]}, "operations", "must not repeat", id="repeat"),
        pytest.param({"operations": ["divide"]}, "operations.0", "Input should be", id="unknown"),
        pytest.param({"operations": []}, "operations", "at least 1 item", id="none"),
        pytest.param({"max_factor": 1}, "max_factor", "greater than or equal to 2", id="factor"),
        pytest.param(
            {"operations": ["multiply"], "max_factor": 2, "num_problems": 577},
            "",
            "Value error, num_problems=577 exceeds the 576 distinct questions",
            id="too-many-problems",
        ),
    ],
)
def test_bad_arguments_stop_start_up_naming_the_field(agent_args, field, message):
    with pytest.raises(EnvConfigError) as info:
        build_agents([{"agent_type": AGENT_TYPE, "agent_args": agent_args}], "envs.yaml")
    text = str(info.value)
    assert text.startswith("env config envs.yaml, entry 0") and message in text
    assert f"field 'agent_args{'.' if field else ''}{field}': " in text


def test_the_prompt_renders_with_smollm2s_chat_template(smollm2_checkpoint):
    """SmolLM2's template adds its default system message; prompt and budget fit 256 tokens."""
    from megatron.rl.models.hf.tokenizer import HuggingFaceTokenizer

    tokenizer = HuggingFaceTokenizer(smollm2_checkpoint)
    arithmetic = env()
    longest = 0
    for index in range(0, 2000, 20):
        problem = arithmetic.problem(index)
        messages = [m.model_dump() for m in problem.messages]
        text = tokenizer.apply_chat_template(messages)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
        assert problem.messages[0].content in text
        longest = max(longest, len(tokenizer.encode_chat(messages)))
    assert longest + arithmetic.args.max_tokens <= 256, longest
