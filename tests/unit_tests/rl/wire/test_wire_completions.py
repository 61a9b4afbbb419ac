"""Wire types of ``POST /v1/completions``: the RL extensions are checked, and a request round
trips between its engine-level form and its completion body."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from megatron.rl.wire import (
    CompletionRequest,
    CompletionUsage,
    InferenceRequest,
    InferenceResponse,
    RolloutKey,
    SamplingParams,
)

USER = {"role": "user", "content": "What is 1+1?"}
KEY = {"batch_id": 0, "index_in_batch": 0, "sample_index": 0}


TOOL = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "turn",
    [
        pytest.param(
            InferenceRequest(messages=[USER], tools=[TOOL], rollout_key=KEY, continued=True),
            id="chat-first-turn",
        ),
        pytest.param(
            InferenceRequest(
                prompt_tokens=[3, 4],
                suffix_messages=[{"role": "tool", "content": "2", "tool_call_id": "c0"}],
                tools=[TOOL],
                rollout_key=KEY,
            ),
            id="chat-later-turn",
        ),
    ],
)
def test_a_chat_episodes_turns_round_trip_through_a_completion_request(turn):
    body = CompletionRequest.from_inference_request(turn)
    assert CompletionRequest.model_validate_json(body.model_dump_json()).to_inference_request() == (
        turn
    )


def test_a_plain_completion_body_has_no_chat_fields():
    body = CompletionRequest.from_inference_request(InferenceRequest(prompt="1="))
    assert not {"messages", "suffix_messages", "tools"} & set(body.model_dump())


def test_a_later_turn_round_trips_through_a_completion_request():
    key = RolloutKey(batch_id=1, index_in_batch=2, sample_index=3)
    sampling = SamplingParams(max_tokens=7, ignore_eos=True)
    turn = InferenceRequest(
        prompt_tokens=[3, 4], prompt_suffix="+", rollout_key=key, seed=5, sampling=sampling
    )
    turn = turn.model_copy(update={"continued": True})
    body = CompletionRequest.from_inference_request(turn)
    assert (body.prompt, body.prompt_suffix, body.continued) == ([3, 4], "+", True)
    assert (body.max_tokens, body.ignore_eos) == (7, True)
    assert CompletionRequest.model_validate_json(body.model_dump_json()).to_inference_request() == (
        turn
    )


@pytest.mark.parametrize(
    "body, needle",
    [
        pytest.param({"prompt": "1=", "prompt_suffix": "+"}, "token ids", id="suffix-on-text"),
        pytest.param({"prompt": [3], "continued": True}, "'rollout_key'", id="unkeyed"),
        pytest.param({"prompt": "1=", "messages": [USER]}, "exactly one", id="prompt-and-chat"),
        pytest.param({}, "exactly one", id="no-prompt"),
        pytest.param(
            {"prompt": [3], "n": 2, "continued": True, "rollout_key": KEY}, "n=1", id="n>1"
        ),
    ],
)
def test_completion_extensions_are_checked(body, needle):
    with pytest.raises(ValidationError, match=needle):
        CompletionRequest.model_validate(body)


def test_usage_counts_the_shared_prompt_once_and_every_sample():
    def sample(n_tokens: int) -> InferenceResponse:
        return InferenceResponse(
            prompt_tokens=[5, 6, 7],
            tokens=[2] * n_tokens,
            text="x" * n_tokens,
            logprobs=[-0.1] * n_tokens,
            policy_versions=[0] * n_tokens,
            finish_reason="length",
        )

    usage = CompletionUsage.of([sample(2), sample(4), sample(1)])
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 7, 10)
