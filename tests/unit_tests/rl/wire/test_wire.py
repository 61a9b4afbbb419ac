"""Pydantic wire types: validation errors that name the field, length checks, JSON round trip."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from megatron.rl.wire import (
    MAX_CHAT_MESSAGES,
    MAX_TOKENS,
    ChatMessage,
    EvaluationRequest,
    GroupedRolloutRequest,
    InferenceRequest,
    InferenceResponse,
    RolloutGroup,
    RolloutKey,
    SamplingParams,
    TokenRollout,
)

USER = {"role": "user", "content": "What is 1+1?"}


def error_locs(err: ValidationError) -> list[tuple]:
    return [e["loc"] for e in err.errors()]


def token_rollout(**overrides) -> TokenRollout:
    fields = dict(
        env_id="copy",
        problem_id="copy:12=",
        prompt="12=",
        completion="12",
        reward=1.0,
        tokens=[3, 4, 14, 3, 4, 1],
        generation_mask=[False, False, False, True, True, True],
        logprobs=[-0.1, -0.2, -0.3],
        policy_versions=[4, 4, 5],
        submission_policy_version=3,
        temperature=0.9,
    )
    fields.update(overrides)
    return TokenRollout(**fields)


def grouped(**overrides) -> GroupedRolloutRequest:
    fields = dict(
        batch_id=2,
        index_in_batch=1,
        groups_in_batch=4,
        group_size=8,
        seed=7,
        submission_policy_version=2,
    )
    fields.update(overrides)
    return GroupedRolloutRequest(**fields)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({}, id="neither"),
        pytest.param({"prompt": "1=", "prompt_tokens": [3, 14]}, id="both"),
    ],
)
def test_inference_request_needs_exactly_one_prompt(kwargs):
    with pytest.raises(ValidationError) as info:
        InferenceRequest(**kwargs)
    message = str(info.value)
    assert "'prompt'" in message and "'prompt_tokens'" in message


@pytest.mark.parametrize(
    "kwargs, field",
    [
        pytest.param({"prompt": ""}, "'prompt'", id="empty-prompt"),
        pytest.param({"prompt_tokens": []}, "'prompt_tokens'", id="empty-prompt-tokens"),
    ],
)
def test_inference_request_rejects_empty_prompt(kwargs, field):
    with pytest.raises(ValidationError, match=field):
        InferenceRequest(**kwargs)


def test_inference_request_accepts_either_prompt_form():
    assert InferenceRequest(prompt="1=").prompt_tokens is None
    assert InferenceRequest(prompt_tokens=[3]).prompt is None
    chat = InferenceRequest(messages=[{"role": "user", "content": "1+1?"}])
    assert chat.messages == [ChatMessage(role="user", content="1+1?")]
    assert chat.prompt is None and chat.prompt_tokens is None


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"prompt": "1=", "messages": [USER]}, id="prompt-and-messages"),
        pytest.param({"prompt_tokens": [3], "messages": [USER]}, id="tokens-and-messages"),
    ],
)
def test_inference_request_messages_are_a_third_exclusive_form(kwargs):
    with pytest.raises(ValidationError, match="exactly one of 'prompt', 'prompt_tokens' and"):
        InferenceRequest(**kwargs)


@pytest.mark.parametrize(
    "messages, needle",
    [
        pytest.param([], "'messages' must not be empty", id="empty"),
        pytest.param([{"role": "robot", "content": "x"}], "messages.0.role", id="unknown-role"),
        pytest.param([{"role": "user"}], "messages.0.content", id="no-content"),
        pytest.param(
            [{"role": "user", "content": "x", "audio": "bob"}], "messages.0.audio", id="extra-field"
        ),
        pytest.param(
            [{"role": "user", "content": "x" * (MAX_TOKENS // 2 + 1)}] * 2,
            f"at most {MAX_TOKENS}",
            id="too-much-content",
        ),
        pytest.param([USER] * (MAX_CHAT_MESSAGES + 1), "messages", id="too-many"),
    ],
)
def test_inference_request_messages_are_bounded_and_named(messages, needle):
    with pytest.raises(ValidationError) as info:
        InferenceRequest(messages=messages)
    assert needle in str(info.value)


def test_inference_response_prompt_text_is_optional():
    fields = dict(prompt_tokens=[3], tokens=[4], text="2", logprobs=[-0.1], policy_versions=[0])
    assert InferenceResponse(**fields, finish_reason="length").prompt_text is None
    rendered = InferenceResponse(**fields, finish_reason="length", prompt_text="<|user|>1=")
    assert InferenceResponse.model_validate_json(rendered.model_dump_json()) == rendered


@pytest.mark.parametrize(
    "seed",
    [pytest.param(-1, id="negative"), pytest.param(2**63, id="too-large")],
)
def test_inference_request_seed_out_of_range(seed):
    with pytest.raises(ValidationError) as info:
        InferenceRequest(prompt="1=", seed=seed)
    assert error_locs(info.value) == [("seed",)]
    InferenceRequest(prompt="1=", seed=2**63 - 1)  # the largest derive_seed value is fine


@pytest.mark.parametrize(
    "kwargs, field",
    [
        pytest.param({"top_p": 0.0}, "top_p", id="top-p-zero"),
        pytest.param({"top_p": 1.5}, "top_p", id="top-p-above-one"),
        pytest.param({"temperature": -0.1}, "temperature", id="negative-temperature"),
        pytest.param({"top_k": -1}, "top_k", id="negative-top-k"),
        pytest.param({"max_tokens": 0}, "max_tokens", id="zero-max-tokens"),
    ],
)
def test_sampling_params_bounds_name_the_field(kwargs, field):
    with pytest.raises(ValidationError) as info:
        SamplingParams(**kwargs)
    assert error_locs(info.value) == [(field,)]


def test_nested_sampling_error_names_the_path():
    with pytest.raises(ValidationError) as info:
        InferenceRequest(prompt="1=", sampling={"top_p": 0})
    assert error_locs(info.value) == [("sampling", "top_p")]


def test_sampling_params_defaults_and_greedy_allowed():
    params = SamplingParams(temperature=0.0, top_p=1.0)
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 1.0, 0)


@pytest.mark.parametrize(
    "model, kwargs",
    [
        pytest.param(SamplingParams, {"topp": 0.5}, id="sampling-params"),
        pytest.param(InferenceRequest, {"prompt": "1=", "sed": 3}, id="inference-request"),
        pytest.param(
            RolloutKey,
            {"batch_id": 0, "index_in_batch": 0, "sample_index": 0, "extra": 1},
            id="rollout-key",
        ),
    ],
)
def test_unknown_field_rejected(model, kwargs):
    with pytest.raises(ValidationError) as info:
        model(**kwargs)
    unknown = next(k for k in kwargs if k not in model.model_fields)
    assert error_locs(info.value) == [(unknown,)]
    assert info.value.errors()[0]["type"] == "extra_forbidden"


def test_unknown_field_rejected_in_token_rollout():
    with pytest.raises(ValidationError) as info:
        token_rollout(rewards=1.0)
    assert ("rewards",) in error_locs(info.value)


@pytest.mark.parametrize(
    "index, groups",
    [
        pytest.param(4, 4, id="equal"),
        pytest.param(5, 4, id="greater"),
    ],
)
def test_grouped_request_index_must_be_inside_batch(index, groups):
    with pytest.raises(ValidationError, match="index_in_batch"):
        grouped(index_in_batch=index, groups_in_batch=groups)


def test_grouped_request_last_index_is_valid():
    assert grouped(index_in_batch=3, groups_in_batch=4).index_in_batch == 3


@pytest.mark.parametrize(
    "overrides, field",
    [
        pytest.param({"group_size": 0}, "group_size", id="empty-group"),
        pytest.param({"seed": -3}, "seed", id="negative-seed"),
        pytest.param({"batch_id": -1}, "batch_id", id="negative-batch"),
    ],
)
def test_grouped_request_field_bounds(overrides, field):
    with pytest.raises(ValidationError) as info:
        grouped(**overrides)
    assert (field,) in error_locs(info.value)


@pytest.mark.parametrize(
    "overrides, field",
    [
        pytest.param({"logprobs": [-0.1, -0.2]}, "'logprobs'", id="too-few-logprobs"),
        pytest.param({"logprobs": [-0.1] * 4}, "'logprobs'", id="too-many-logprobs"),
        pytest.param({"policy_versions": [4, 4]}, "'policy_versions'", id="too-few-versions"),
        pytest.param(
            {"generation_mask": [False, True, True, True]}, "'generation_mask'", id="short-mask"
        ),
    ],
)
def test_token_rollout_lengths_must_agree(overrides, field):
    with pytest.raises(ValidationError, match=field):
        token_rollout(**overrides)


def test_a_rollout_with_an_error_is_a_placeholder():
    assert not token_rollout().is_placeholder
    empty = token_rollout(
        tokens=[], generation_mask=[], logprobs=[], policy_versions=[], error="boom"
    )
    assert empty.is_placeholder


def test_rollout_group_needs_a_rollout():
    with pytest.raises(ValidationError) as info:
        RolloutGroup(batch_id=0, index_in_batch=0, rollouts=[])
    assert error_locs(info.value) == [("rollouts",)]


def test_rollout_group_json_round_trip():
    group = RolloutGroup(
        batch_id=3,
        index_in_batch=1,
        rollouts=[
            token_rollout(),
            token_rollout(
                reward=0.0,
                error="ValueError: reward failed",
                tokens=[],
                generation_mask=[],
                logprobs=[],
                policy_versions=[],
            ),
        ],
    )
    text = group.model_dump_json()
    back = RolloutGroup.model_validate_json(text)
    assert back == group
    assert back.rollouts[0].logprobs == [-0.1, -0.2, -0.3]
    assert back.rollouts[1].is_placeholder
    assert back.model_dump_json() == text


def test_inference_response_finish_reason_is_checked():
    fields = dict(prompt_tokens=[3], tokens=[4], text="2", logprobs=[-1.0], policy_versions=[0])
    assert InferenceResponse(**fields, finish_reason="stop").finish_reason == "stop"
    with pytest.raises(ValidationError) as info:
        InferenceResponse(**fields, finish_reason="eos")
    assert error_locs(info.value) == [("finish_reason",)]


@pytest.mark.parametrize("reward", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_reward_is_rejected_or_survives_json(reward):
    """Server and client validate against the same model: what validates must round-trip."""
    try:
        rollout = token_rollout(reward=reward)
    except ValidationError as err:
        assert ("reward",) in error_locs(err)
        return
    group = RolloutGroup(batch_id=0, index_in_batch=0, rollouts=[rollout])
    back = RolloutGroup.model_validate_json(group.model_dump_json())
    assert str(back.rollouts[0].reward) == str(reward)


# --------------------------------------------------------------------------- multi-turn fields


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        pytest.param({"prompt": "1=", "prompt_suffix": "+"}, "'prompt_suffix' needs", id="text"),
        pytest.param({"prompt_tokens": [3], "prompt_suffix": ""}, "'prompt_suffix'", id="empty"),
        pytest.param(
            {"prompt_tokens": [3] * MAX_TOKENS, "prompt_suffix": "+"}, "exceed", id="too-long"
        ),
        pytest.param({"prompt": "1=", "continued": True}, "'continued' needs", id="unkeyed"),
    ],
)
def test_multi_turn_fields_are_checked(kwargs, needle):
    with pytest.raises(ValidationError, match=needle):
        InferenceRequest(**kwargs)


def test_eval_prompts_is_bounded():
    assert grouped().eval_prompts is None and grouped(eval_prompts=32).eval_prompts == 32
    with pytest.raises(ValidationError) as info:
        grouped(eval_prompts=0)
    assert error_locs(info.value) == [("eval_prompts",)]


# --------------------------------------------------------------------------- base URLs


@pytest.mark.parametrize(
    "url, needle",
    [
        pytest.param("http://127.0.0.1:99999", "port 99999 is outside 1-65535", id="port-overflow"),
        pytest.param("http://127.0.0.1:0", "port 0 is outside", id="port-0"),
        pytest.param(
            "http://127.0.0.1:P.example", "Invalid port: 'P.example'", id="port-not-number"
        ),
        pytest.param("http://xn--:8000", "Malformed A-label", id="bad-idna-host"),
        pytest.param("http://:8000", "no host", id="no-host"),
        pytest.param("http://user@trainer:8000", "should match pattern", id="userinfo"),
        pytest.param("ftp://trainer:8000", "should match pattern", id="scheme"),
        pytest.param("http://trainer:8000/?q=1", "no query or fragment", id="query"),
    ],
)
def test_a_base_url_httpx_cannot_call_is_refused_naming_the_field(url, needle):
    with pytest.raises(ValidationError) as info:
        EvaluationRequest(inference_url=url)
    assert error_locs(info.value) == [("inference_url",)]
    assert needle in info.value.errors()[0]["msg"]


@pytest.mark.parametrize(
    "url",
    ["http://trainer:9000", "https://Trainer", "http://[::1]:65535/prefix/", "http://127.0.0.1:1"],
)
def test_base_urls_httpx_can_call_are_kept_as_given(url):
    assert EvaluationRequest(inference_url=url).inference_url == url
