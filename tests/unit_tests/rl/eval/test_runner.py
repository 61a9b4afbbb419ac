"""Evaluation on a held-out set: greedy reward, pass@k, deterministic and apart from training."""

from __future__ import annotations

import asyncio
import random

import pytest
from grpo_testing.fakes import SeededInference

from megatron.rl.environments.digits import DigitTaskArgs, DigitTaskEnvironment
from megatron.rl.eval.runner import (
    EVAL_STREAM,
    EvalConfig,
    eval_metrics,
    evaluate_agents,
)
from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.seeding import derive_seed
from megatron.rl.tokenizer import CharTokenizer
from megatron.rl.wire import InferenceRequest, InferenceResponse


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
            prompt_tokens=self.tokenizer.encode(prompt), tokens=tokens,
            text=text, logprobs=[-0.1] * len(tokens), policy_versions=[0] * len(tokens),
            finish_reason="stop",
        )  # fmt: skip


def copy_env(env_id: str = "copy") -> DigitTaskEnvironment:
    return DigitTaskEnvironment(env_id, DigitTaskArgs(task="copy", min_digits=1, max_digits=3))


def test_greedy_reward_and_pass_at_k_by_hand():
    # every greedy answer is right; 2 of the 4 samples of each problem are right (sample 0, 1)
    inference = EchoInference(CharTokenizer())
    config = EvalConfig(num_prompts=5, samples_per_prompt=4, pass_k=(1, 2, 4), seed=3)
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
    config = EvalConfig(num_prompts=3, samples_per_prompt=1, seed=3)
    asyncio.run(evaluate_agents([copy_env()], inference, config))
    env = copy_env()
    eval_seed = derive_seed(3, EVAL_STREAM)
    expected = [
        env.make_problem(random.Random(derive_seed(eval_seed, i, 0))).prompt for i in range(3)
    ]
    assert [r.prompt for r in inference.requests[:3]] == expected
    assert eval_seed != 3


def test_results_are_deterministic_and_metrics_are_per_environment():
    config = EvalConfig(num_prompts=4, samples_per_prompt=3, pass_k=(1, 3), seed=11)
    agents = [copy_env("a"), copy_env("b")]
    first = asyncio.run(evaluate_agents(agents, SeededInference(), config))
    second = asyncio.run(evaluate_agents(agents, SeededInference(), config))
    assert first == second
    metrics = eval_metrics(first)
    assert set(metrics) == {
        "eval/greedy_reward", "eval/greedy_reward/a", "eval/greedy_reward/b",
        "eval/sample_reward", "eval/sample_reward/a", "eval/sample_reward/b",
        "eval/pass@1", "eval/pass@1/a", "eval/pass@1/b",
        "eval/pass@3", "eval/pass@3/a", "eval/pass@3/b", "eval/failed",
    }  # fmt: skip
    assert metrics["eval/pass@1"] == pytest.approx(
        (metrics["eval/pass@1/a"] + metrics["eval/pass@1/b"]) / 2
    )


def test_pass_k_above_samples_is_rejected():
    with pytest.raises(ValueError, match="pass@k"):
        EvalConfig(samples_per_prompt=2, pass_k=(4,))
