"""Wire types of the chat completions endpoint: validation naming the field, the budget, and the
conversions to and from engine-level requests and responses."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from megatron.rl.wire import (
    DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    ChatCompletionResponse,
    InferenceRequest,
    RolloutKey,
    SamplingParams,
)

USER = {"role": "user", "content": "What is 1+1?"}


@pytest.mark.parametrize(
    "kwargs, budget",
    [
        pytest.param({}, DEFAULT_MAX_TOKENS, id="default"),
        pytest.param({"max_tokens": 7}, 7, id="max-tokens"),
        pytest.param({"max_completion_tokens": 9}, 9, id="max-completion-tokens"),
        pytest.param({"max_tokens": 5, "max_completion_tokens": 5}, 5, id="both-equal"),
    ],
)
def test_budget(kwargs, budget):
    request = ChatCompletionRequest(messages=[USER], **kwargs)
    assert request.budget == budget
    assert request.to_inference_request().sampling.max_tokens == budget


@pytest.mark.parametrize(
    "kwargs, loc",
    [
        pytest.param({"top_logprobs": 21}, ("top_logprobs",), id="top-logprobs-over-20"),
        pytest.param({"stream": [True]}, ("stream",), id="stream-not-a-bool"),
        pytest.param({"response_format": {"type": "json"}}, ("response_format",), id="format"),
        pytest.param({"presence_penalty": 0.5}, ("presence_penalty",), id="penalty"),
        pytest.param({"max_completion_tokens": 0}, ("max_completion_tokens",), id="zero-budget"),
    ],
)
def test_unsupported_or_bad_parameters_name_the_field(kwargs, loc):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest(messages=[USER], **kwargs)
    assert [e["loc"] for e in info.value.errors()] == [loc]


def test_top_logprobs_need_logprobs_and_reach_the_engine():
    body = ChatCompletionRequest(messages=[USER], logprobs=True, top_logprobs=20, stop="\n\n")
    assert body.to_inference_request().sampling.top_logprobs == 20
    assert body.to_inference_request().sampling.stop == ["\n\n"]
    with pytest.raises(ValidationError, match="'top_logprobs' needs 'logprobs'"):
        ChatCompletionRequest(messages=[USER], top_logprobs=3)


def test_round_trip_through_an_engine_level_request():
    key = RolloutKey(batch_id=2, index_in_batch=1, sample_index=0)
    request = InferenceRequest(
        messages=[{"role": "system", "content": "Be brief."}, USER],
        sampling=SamplingParams(
            temperature=0.7, top_p=0.9, top_k=5, max_tokens=12, ignore_eos=True
        ),
        seed=99,
        rollout_key=key,
    )
    chat = ChatCompletionRequest.from_inference_request(request, n=4)
    assert (chat.n, chat.logprobs, chat.max_completion_tokens, chat.ignore_eos) == (
        4,
        True,
        12,
        True,
    )
    wire = ChatCompletionRequest.model_validate_json(chat.model_dump_json())
    assert wire.to_inference_request() == request


def test_only_a_messages_request_becomes_a_chat_completion():
    with pytest.raises(ValueError, match="'messages'"):
        ChatCompletionRequest.from_inference_request(InferenceRequest(prompt="1="))


def response(logprobs: bool = True) -> dict:
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "2"},
        "finish_reason": "stop",
        "token_ids": [9, 2],
        "prompt_token_ids": [5, 6, 7],
        "policy_versions": [3, 4],
        "prompt_text": "<|user|>What is 1+1?<|end|><|assistant|>",
    }
    if logprobs:
        entries = [
            {"token": "2", "logprob": -0.5, "bytes": [50], "top_logprobs": []},
            {"token": "", "logprob": -0.25, "bytes": [], "top_logprobs": []},
        ]
        choice["logprobs"] = {"content": entries}
    later = {**choice, "index": 1, "token_ids": [8], "policy_versions": [4]}
    if logprobs:
        later["logprobs"] = {"content": choice["logprobs"]["content"][:1]}
    usage = {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    return {
        "id": "chatcmpl-0",
        "created": 0,
        "model": "p",
        "choices": [later, choice],
        "usage": usage,
    }


def test_response_becomes_engine_level_responses_by_index():
    first, second = ChatCompletionResponse.model_validate(response()).to_inference_responses()
    assert (first.tokens, first.logprobs, first.policy_versions) == ([9, 2], [-0.5, -0.25], [3, 4])
    assert first.text == "2" and first.prompt_tokens == [5, 6, 7]
    assert first.prompt_text == "<|user|>What is 1+1?<|end|><|assistant|>"
    assert second.tokens == [8]


def test_response_without_logprobs_cannot_feed_training():
    parsed = ChatCompletionResponse.model_validate(response(logprobs=False))
    with pytest.raises(ValueError, match="logprobs=true"):
        parsed.to_inference_responses()
