"""``SingleTurnEnvironment`` with prompts given as chat messages: the request carries them, the
trainer's tokenizer renders them, and the rollout's prompt is the rendered conversation."""

from __future__ import annotations

import asyncio
import random

import pytest
from grpo_testing.fakes import FakeSteps
from pydantic import ValidationError

from megatron.rl.agent.api import Problem, SingleTurnEnvironment
from megatron.rl.inference.interface import LocalInferenceInterface
from megatron.rl.inference.scheduler import ContinuousBatchingScheduler, SchedulerConfig
from megatron.rl.models.hf.tokenizer import HuggingFaceTokenizer
from megatron.rl.tokenizer import CharTokenizer
from megatron.rl.wire import (
    MAX_CHAT_MESSAGES,
    ChatMessage,
    GroupedRolloutRequest,
    InferenceRequest,
    SamplingParams,
)

SYSTEM = {"role": "system", "content": "Copy the number."}


class ChatEcho(SingleTurnEnvironment):
    """A number to copy, asked as a conversation; reward 1 for any non-empty completion."""

    def __init__(self, messages_per_problem: int = 1) -> None:
        super().__init__("chat-echo")
        self.messages_per_problem = messages_per_problem

    def make_problem(self, rng: random.Random) -> Problem:
        n = str(rng.randrange(1000))
        user = {"role": "user", "content": n}
        messages = [SYSTEM] + [user] * self.messages_per_problem
        return Problem(problem_id=f"echo:{n}", prompt=None, answer=n, messages=messages)

    def reward(self, problem: Problem, completion: str) -> float:
        return 1.0 if completion else 0.5


class Recording(LocalInferenceInterface):
    """The in-process interface, recording the requests it serves."""

    requests: list[InferenceRequest]

    async def generate(self, request: InferenceRequest):
        self.requests.append(request)
        return await super().generate(request)


def run_group(env: SingleTurnEnvironment, tokenizer, group_size: int = 3):
    """One group of ``env`` through a running engine (fake steps) and ``tokenizer``."""
    request = GroupedRolloutRequest(
        batch_id=1,
        index_in_batch=0,
        groups_in_batch=1,
        group_size=group_size,
        seed=42,
        submission_policy_version=6,
        sampling=SamplingParams(max_tokens=4),
    )

    async def run():
        engine = ContinuousBatchingScheduler(
            FakeSteps(), SchedulerConfig(max_requests=4, max_seq_len=64), lambda: 6
        )
        engine.start()
        engine.resume()
        inference = Recording(engine, tokenizer)
        inference.requests = []
        try:
            return await env.group_rollout(request, inference), inference.requests
        finally:
            await engine.aclose()

    return asyncio.run(run())


def test_chat_problem_is_rendered_by_the_trainer_tokenizer(tiny_hf_checkpoints):
    tokenizer = HuggingFaceTokenizer(tiny_hf_checkpoints["llama3"])
    group, requests = run_group(ChatEcho(), tokenizer)
    assert all(r.messages[0] == ChatMessage(**SYSTEM) and r.prompt is None for r in requests)
    assert len(requests) == 3
    messages = [m.model_dump() for m in requests[0].messages]
    rendered = tokenizer.apply_chat_template(messages)
    prompt_tokens = tokenizer.encode_chat(messages)
    assert rendered.startswith("<|bos|><|system|>Copy the number.<|end|><|user|>")
    for rollout in group.rollouts:
        assert not rollout.is_placeholder
        assert rollout.prompt == rendered
        assert rollout.tokens[: len(prompt_tokens)] == prompt_tokens
        assert sum(rollout.generation_mask) == len(rollout.tokens) - len(prompt_tokens)
        assert rollout.reward in (0.5, 1.0)


def test_chat_problem_with_the_character_tokenizer_gives_placeholders_naming_it():
    group, requests = run_group(ChatEcho(), CharTokenizer())
    assert len(requests) == 3
    for rollout in group.rollouts:
        assert rollout.is_placeholder and rollout.reward == 0.0
        assert "messages: the tokenizer (CharTokenizer) has no chat template" in rollout.error


def test_a_conversation_the_wire_refuses_masks_the_group_without_inference():
    group, requests = run_group(ChatEcho(messages_per_problem=MAX_CHAT_MESSAGES), CharTokenizer())
    assert requests == []
    assert all(r.is_placeholder and "messages" in r.error for r in group.rollouts)


@pytest.mark.parametrize(
    "prompt, messages",
    [
        pytest.param("1=", [SYSTEM], id="both"),
        pytest.param(None, None, id="neither"),
    ],
)
def test_problem_needs_exactly_one_prompt_form(prompt, messages):
    with pytest.raises(ValueError, match="problem p: give exactly one of 'prompt' and 'messages'"):
        Problem(problem_id="p", prompt=prompt, answer="1", messages=messages)


def test_problem_messages_are_validated_wire_messages():
    problem = Problem(problem_id="p", prompt=None, answer="1", messages=[SYSTEM])
    assert problem.messages == (ChatMessage(**SYSTEM),)
    with pytest.raises(ValidationError, match="role"):
        Problem(problem_id="p", prompt=None, answer="1", messages=[{"role": "bot", "content": ""}])
    with pytest.raises(ValueError, match="'messages' must not be empty"):
        Problem(problem_id="p", prompt=None, answer="1", messages=[])
