"""Evaluation on a held-out set: greedy reward, pass@k, deterministic and apart from training."""

from __future__ import annotations

import asyncio
import random

import pytest
from grpo_testing.fakes import SeededInference

from megatron.rl.agent.api import Problem
from megatron.rl.agent.dataset import DatasetEnvironment
from megatron.rl.environments.digits import DigitTaskArgs, DigitTaskEnvironment
from megatron.rl.eval.runner import (
    EVAL_STREAM,
    EvalConfig,
    ResponseLengths,
    eval_metrics,
    evaluate_agents,
)
from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.seeding import derive_seed
from megatron.rl.tokenizer import CharTokenizer
from megatron.rl.wire import InferenceRequest, InferenceResponse, SamplingParams


class EchoInference(InferenceInterface):
    """Greedy requests copy the prompt's digits (correct on the copy task); sampled requests
    are correct for sample indices 0 and 1 and wrong ("000000000") for the others."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: list[InferenceRequest] = []

    async def generate(self, request: InferenceRequest) -> InferenceResponse:
        self.requests.append(request)
        prompt = request.prompt
        right = request.sampling.temperature == 0 or request.rollout_key.sample_index < 2
        text = prompt[:-1] if right else "x"
        tokens = self.tokenizer.encode(text.replace("x", "0" * 9)) + [self.tokenizer.eos_id]
        return InferenceResponse(
            prompt_tokens=self.tokenizer.encode(prompt),
            tokens=tokens,
            text=text,
            logprobs=[-0.1] * len(tokens),
            policy_versions=[0] * len(tokens),
            finish_reason="stop",
        )


def copy_env(env_id: str = "copy") -> DigitTaskEnvironment:
    return DigitTaskEnvironment(env_id, DigitTaskArgs(task="copy", min_digits=1, max_digits=3))


def test_greedy_reward_and_pass_at_k_by_hand():
    # every greedy answer is right; 2 of the 4 samples of each problem are right (sample 0, 1)
    inference = EchoInference(CharTokenizer())
    config = EvalConfig(
        num_prompts=5, samples_per_prompt=4, pass_k=(1, 2, 4), correct_threshold=1.0, seed=3
    )
    (result,) = asyncio.run(evaluate_agents([copy_env()], inference, config))
    assert result.greedy_reward == 1.0
    assert result.pass_at_k[1] == pytest.approx(0.5)
    assert result.pass_at_k[2] == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)
    assert result.pass_at_k[4] == 1.0
    assert result.failed == 0
    greedy = [r for r in inference.requests if r.sampling.temperature == 0]
    sampled = [r for r in inference.requests if r.sampling.temperature > 0]
    assert len(greedy) == 5 and len(sampled) == 20


def test_held_out_prompts_come_from_their_own_seed_stream():
    inference = EchoInference(CharTokenizer())
    config = EvalConfig(
        num_prompts=3, samples_per_prompt=1, pass_k=(1,), correct_threshold=1.0, seed=3
    )
    asyncio.run(evaluate_agents([copy_env()], inference, config))
    env = copy_env()
    eval_seed = derive_seed(3, EVAL_STREAM)
    expected = [
        env.make_problem(random.Random(derive_seed(eval_seed, i, 0))).prompt for i in range(3)
    ]
    assert [r.prompt for r in inference.requests[:3]] == expected
    assert eval_seed != 3


def test_results_are_deterministic_and_metrics_are_per_environment():
    config = EvalConfig(
        num_prompts=4, samples_per_prompt=3, pass_k=(1, 3), correct_threshold=1.0, seed=11
    )
    agents = [copy_env("a"), copy_env("b")]
    first = asyncio.run(evaluate_agents(agents, SeededInference(), config))
    second = asyncio.run(evaluate_agents(agents, SeededInference(), config))
    assert first == second
    metrics = eval_metrics(first)
    assert set(metrics) == {
        "eval/greedy_reward",
        "eval/greedy_reward/a",
        "eval/greedy_reward/b",
        "eval/sample_reward",
        "eval/sample_reward/a",
        "eval/sample_reward/b",
        "eval/pass@1",
        "eval/pass@1/a",
        "eval/pass@1/b",
        "eval/pass@3",
        "eval/pass@3/a",
        "eval/pass@3/b",
        "eval/failed",
        "eval/prompts",
        "eval/prompts/a",
        "eval/prompts/b",
        *(
            f"eval/{p}_{m}{env}"
            for p in ("greedy", "sample")
            for env in ("", "/a", "/b")
            for m in ("response_length_mean", "response_length_max", "truncated_fraction")
        ),
    }
    assert metrics["eval/prompts"] == 8  # 4 per environment
    assert metrics["eval/pass@1"] == pytest.approx(
        (metrics["eval/pass@1/a"] + metrics["eval/pass@1/b"]) / 2
    )


def test_pass_k_above_samples_is_rejected():
    with pytest.raises(ValueError, match="pass@k"):
        EvalConfig(num_prompts=1, samples_per_prompt=2, pass_k=(4,), correct_threshold=1.0, seed=0)


class NumberedProblems(DatasetEnvironment):
    """Problem i asks for the number i (its answer)."""

    def num_problems(self) -> int:
        return 10

    def problem(self, index: int) -> Problem:
        return Problem(problem_id=f"p{index}", prompt=f"{index}=", answer=str(index))

    def reward(self, problem: Problem, completion: str) -> float:
        return float(completion == problem.answer)


class AnswerInference(InferenceInterface):
    """Greedy and sample 1 answer right and stop (EOS); sample 0 writes "9999" and runs out of
    its 4-token budget (truncated)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    async def generate(self, request: InferenceRequest) -> InferenceResponse:
        right = request.sampling.temperature == 0 or request.rollout_key.sample_index == 1
        text = request.prompt[:-1] if right else "9999"
        tokens = self.tokenizer.encode(text) + ([self.tokenizer.eos_id] if right else [])
        return InferenceResponse(
            prompt_tokens=self.tokenizer.encode(request.prompt),
            tokens=tokens,
            text=text,
            logprobs=[-0.1] * len(tokens),
            policy_versions=[0] * len(tokens),
            finish_reason="stop" if right else "length",
        )


@pytest.mark.parametrize(
    "num_prompts, evaluated",
    [pytest.param(5, 3, id="all-3-held-out"), pytest.param(2, 2, id="capped-by-num-prompts")],
)
def test_a_held_out_partition_is_evaluated_once_with_lengths_and_records(num_prompts, evaluated):
    tokenizer = CharTokenizer()
    env = NumberedProblems("numbers")
    env.hold_out(0.3)
    config = EvalConfig(
        num_prompts=num_prompts,
        samples_per_prompt=2,
        pass_k=(1, 2),
        correct_threshold=1.0,
        seed=3,
        sampling=SamplingParams(max_tokens=4),
        stop_token_ids=(tokenizer.eos_id,),
    )
    (result,) = asyncio.run(evaluate_agents([env], AnswerInference(tokenizer), config))
    held_out = [f"p{i}" for i in env.validation_indices[:evaluated]]
    assert result.prompts == evaluated
    assert (result.greedy_reward, result.sample_reward, result.pass_at_k) == (
        1.0,
        0.5,
        {1: 0.5, 2: 1.0},
    )
    # greedy: one digit + EOS; sampled: 4 tokens cut off, and one digit + EOS
    assert result.greedy_lengths == ResponseLengths(mean=2.0, max=2, truncated_fraction=0.0)
    assert result.sample_lengths == ResponseLengths(mean=3.0, max=4, truncated_fraction=0.5)
    records = result.records
    assert len(records) == evaluated * 3  # one greedy and two sampled rollouts per problem
    assert [r["problem_id"] for r in records if r["pass"] == "greedy"] == held_out
    assert [(r["problem_id"], r["sample"]) for r in records if r["pass"] == "sample"] == [
        (p, k) for p in held_out for k in (0, 1)
    ]
    for r in records:
        cut = r["pass"] == "sample" and r["sample"] == 0
        assert r["truncated"] is cut and r["response_tokens"] == (4 if cut else 2)
        assert r["reward"] == (0.0 if cut else 1.0)
        assert r["response"] == ("9999" if cut else r["prompt"][:-1])
