"""The GSM8K environment: arguments checked at start-up naming file and field, reproducible
problems, the reward, and groups generated in process by the real engine (scheduler + KV-cache
runner) over a tiny Hugging Face model and its tokenizer."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from pathlib import Path

import httpx
import pytest
from grpo_testing.hf_engine import load_hf_policy, running_engine

from examples.rl.environments.gsm8k import GSM8KArgs, GSM8KEnvironment
from megatron.rl.agent.api import Problem
from megatron.rl.agent.env_config import EnvConfigError, build_agents
from megatron.rl.inference.interface import LocalInferenceInterface
from megatron.rl.models.hf.tokenizer import HuggingFaceTokenizer
from megatron.rl.seeding import derive_seed
from megatron.rl.server.env_server import create_app
from megatron.rl.server.http import EmbeddedServer
from megatron.rl.server.inference_server import create_inference_app
from megatron.rl.wire import (
    GroupedRolloutCall,
    GroupedRolloutRequest,
    RolloutGroup,
    SamplingParams,
)

ROOT = Path(__file__).resolve().parents[6]
SAMPLE = str(ROOT / "examples/rl/environments/gsm8k/gsm8k_sample.jsonl")
AGENT_TYPE = "examples.rl.environments.gsm8k:GSM8KEnvironment"


def env(datasets_cache, **args) -> GSM8KEnvironment:
    fields = {"data_files": SAMPLE, "cache_dir": datasets_cache, **args}
    return GSM8KEnvironment("gsm8k", GSM8KArgs(**fields))


def build(agent_args: dict):
    return build_agents([{"agent_type": AGENT_TYPE, "agent_args": agent_args}], "envs.yaml")


def test_missing_file_stops_start_up_naming_file_and_field(tmp_path):
    missing = tmp_path / "gsm8k.jsonl"
    with pytest.raises(EnvConfigError) as info:
        build({"data_files": str(missing)})
    message = str(info.value)
    assert message.startswith("env config envs.yaml, entry 0")
    assert f"field 'agent_args.data_files': Value error, {missing}: no such file" in message


def test_row_without_final_answer_stops_start_up_naming_the_row(tmp_path, datasets_cache):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"question": "How many?", "answer": "Some."}) + "\n")
    with pytest.raises(EnvConfigError, match=f"{path} row 0: field 'answer' has no final answer"):
        build({"data_files": str(path), "cache_dir": datasets_cache})


@pytest.mark.parametrize(
    "args, field",
    [
        pytest.param({"prompt_style": "plain", "system_prompt": "Hi"}, "system_prompt", id="sys"),
        pytest.param({"prompt_template": "Q:"}, "prompt_template", id="template"),
        pytest.param({"format_reward": 1.5}, "format_reward", id="format-reward"),
        pytest.param({"answer_extraction": "first"}, "answer_extraction", id="extraction"),
        pytest.param({"prompt_style": "xml"}, "prompt_style", id="style"),
    ],
)
def test_bad_arguments_name_the_field(args, field, datasets_cache):
    with pytest.raises(EnvConfigError, match=f"field 'agent_args.{field}'"):
        build({"data_files": SAMPLE, "cache_dir": datasets_cache, **args})


def test_problems_are_drawn_reproducibly_from_the_given_rng(datasets_cache):
    gsm8k = env(datasets_cache)
    seeds = [derive_seed(1234, b, 0) for b in range(40)]
    first = [gsm8k.make_problem(random.Random(s)) for s in seeds]
    again = [env(datasets_cache).make_problem(random.Random(s)) for s in seeds]
    assert first == again
    assert len({p.problem_id for p in first}) > 10  # draws spread over the 20 problems


def test_plain_and_chat_prompts(datasets_cache):
    rng_seed = derive_seed(7, 0, 0)
    plain = env(datasets_cache, prompt_style="plain", prompt_template="Q: {question}\nA:")
    problem = plain.make_problem(random.Random(rng_seed))
    record = next(r for r in plain.records if r.source == problem.problem_id)
    assert problem.prompt == f"Q: {record.question}\nA:" and problem.messages is None
    assert problem.answer == record.answer
    chat = env(datasets_cache, system_prompt="You are a careful solver.", max_tokens=64)
    problem = chat.make_problem(random.Random(rng_seed))
    assert problem.prompt is None and problem.max_tokens == 64
    assert [(m.role, m.content.split("\n")[0]) for m in problem.messages] == [
        ("system", "You are a careful solver."),
        ("user", record.question),
    ]
    assert problem.messages[1].content.endswith("final answer within \\boxed{}.")


@pytest.mark.parametrize(
    "completion, extraction, reward",
    [
        pytest.param("12 + 7 = 19, 19 - 5 = 14. \\boxed{14}", "auto", 1.0, id="boxed-right"),
        pytest.param("#### 14", "auto", 1.0, id="hashes-right"),
        pytest.param("She has 14 apples", "auto", 1.0, id="bare-number-right"),
        pytest.param("\\boxed{15}", "auto", 0.2, id="boxed-wrong-gets-format"),
        pytest.param("She has 15 apples", "auto", 0.0, id="bare-number-wrong"),
        pytest.param("She has 14 apples", "boxed", 0.0, id="unboxed-when-boxed-asked"),
        pytest.param("\\boxed{14.0}", "boxed", 1.0, id="equivalent"),
        pytest.param("no answer", "auto", 0.0, id="nothing"),
    ],
)
def test_reward(completion, extraction, reward, datasets_cache):
    gsm8k = env(datasets_cache, answer_extraction=extraction, format_reward=0.2)
    problem = Problem("gsm8k_sample.jsonl:0", "prompt", "14")
    assert gsm8k.reward(problem, completion) == reward


@pytest.mark.parametrize(
    "completion, reward",
    [
        pytest.param("\\boxed{} = 4 + 7 = 11", 0.0, id="hack-empty-box"),
        pytest.param("\\boxed{ } so 11", 0.0, id="hack-blank-box"),
        pytest.param("#### \nso 11", 0.0, id="hack-bare-hashes"),
        pytest.param("\\boxed{apples}", 0.0, id="hack-unparseable-box"),
        pytest.param("4 + 7 = 11. \\boxed{11}", 0.1, id="wrong-number-boxed"),
        pytest.param("#### 11", 0.1, id="wrong-number-hashes"),
        pytest.param("4 + 8 = 12. \\boxed{12}", 1.0, id="right"),
        pytest.param("\\boxed{} = 4 + 8 = 12", 1.0, id="empty-box-right-last-number"),
    ],
)
def test_the_empty_box_earns_no_format_reward(completion, reward, datasets_cache):
    """The reward hack of a 20-step SmolLM2 run: an empty box collected the format reward."""
    gsm8k = env(datasets_cache, format_reward=0.1)
    assert gsm8k.reward(Problem("gsm8k_sample.jsonl:0", "prompt", "12"), completion) == reward


def groups(gsm8k: GSM8KEnvironment, directory: Path, tokenizer_directory: Path | None = None):
    """Four groups of four rollouts from the engine over the checkpoint in ``directory``."""
    model, tokenizer = load_hf_policy(directory)
    if tokenizer_directory is not None:
        tokenizer = HuggingFaceTokenizer(tokenizer_directory)

    async def run():
        async with running_engine(
            model, tokenizer.vocab_size, tokenizer.eos_id, 16, 256, lambda: 2
        ) as engine:
            inference = LocalInferenceInterface(engine, tokenizer)
            requests = [
                GroupedRolloutRequest(
                    batch_id=3,
                    index_in_batch=i,
                    groups_in_batch=4,
                    group_size=4,
                    seed=1234,
                    submission_policy_version=2,
                    sampling=SamplingParams(temperature=1.0, max_tokens=24),
                )
                for i in range(4)
            ]
            return await asyncio.gather(*(gsm8k.group_rollout(r, inference) for r in requests))

    return asyncio.run(run()), tokenizer


@pytest.mark.parametrize("style", ["chat", "plain"])
def test_groups_from_the_engine_have_rewards_in_range(
    style, single_rank_world, gsm8k_checkpoint, datasets_cache
):
    extra = {"system_prompt": "Solve it."} if style == "chat" else {}
    gsm8k = env(datasets_cache, prompt_style=style, format_reward=0.1, **extra)
    out, tokenizer = groups(gsm8k, gsm8k_checkpoint)
    for index, group in enumerate(out):
        problem = gsm8k.make_problem(random.Random(derive_seed(1234, 3, index)))
        assert (group.batch_id, group.index_in_batch) == (3, index)
        for rollout in group.rollouts:
            assert not rollout.is_placeholder, rollout.error
            assert rollout.problem_id == problem.problem_id
            if style == "chat":
                messages = [m.model_dump() for m in problem.messages]
                assert rollout.prompt == tokenizer.apply_chat_template(messages)
                prompt_tokens = tokenizer.encode_chat(messages)
            else:
                assert rollout.prompt == problem.prompt
                prompt_tokens = tokenizer.encode(problem.prompt)
            assert len(prompt_tokens) + 24 <= 256
            assert rollout.tokens[: len(prompt_tokens)] == prompt_tokens
            assert 1 <= sum(rollout.generation_mask) <= 24
            assert rollout.policy_versions == [2] * sum(rollout.generation_mask)
            assert rollout.reward in (0.0, 0.1, 1.0)
            assert rollout.reward == gsm8k.reward(problem, rollout.completion)
    completions = {r.completion for g in out for r in g.rollouts}
    assert len(completions) > 4  # sampled, not one repeated answer


def test_chat_prompts_with_a_tokenizer_without_a_template_are_placeholders(
    single_rank_world, gsm8k_checkpoint, datasets_cache, tmp_path
):
    plain_tokenizer = shutil.copytree(gsm8k_checkpoint, tmp_path / "no_template")
    (plain_tokenizer / "chat_template.jinja").unlink()
    out, _ = groups(env(datasets_cache), gsm8k_checkpoint, plain_tokenizer)
    for rollout in (r for g in out for r in g.rollouts):
        assert rollout.is_placeholder and rollout.reward == 0.0
        assert "has no chat template" in rollout.error and "messages" in rollout.error


def test_the_env_server_generates_chat_groups_through_the_inference_server(
    single_rank_world, gsm8k_checkpoint, datasets_cache
):
    """GSM8K on the env server: its chat prompts travel to the trainer's inference server, which
    renders them with its tokenizer; the group equals the in-process one."""
    model, tokenizer = load_hf_policy(gsm8k_checkpoint)
    agent_args = {"data_files": SAMPLE, "cache_dir": datasets_cache, "max_tokens": 16}
    request = GroupedRolloutRequest(
        batch_id=0,
        index_in_batch=0,
        groups_in_batch=1,
        group_size=3,
        seed=5,
        submission_policy_version=0,
    )

    async def run():
        async with running_engine(model, tokenizer.vocab_size, tokenizer.eos_id, 8, 256) as engine:
            local = LocalInferenceInterface(engine, tokenizer)
            in_process = await build(agent_args).agents[0].group_rollout(request, local)
            trainer = httpx.ASGITransport(create_inference_app(local, tokenizer))
            server = await EmbeddedServer.start(
                create_app(build(agent_args), transport=trainer), "127.0.0.1", 0
            )
            call = GroupedRolloutCall(request=request, inference_url="http://trainer:1")
            try:
                async with httpx.AsyncClient() as client:
                    answer = await client.post(
                        f"{server.url}/v1/grouped_rollouts", json=call.model_dump(mode="json")
                    )
            finally:
                await server.stop()
            return in_process, answer

    in_process, answer = asyncio.run(run())
    assert answer.status_code == 200, answer.text
    remote = RolloutGroup.model_validate(answer.json())
    assert not any(r.is_placeholder for r in remote.rollouts)
    assert remote.rollouts[0].prompt.endswith("<|assistant|>")
    assert remote == in_process
