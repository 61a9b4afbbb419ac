"""``POST /v1/chat/completions`` of the trainer's inference server, driven by the official
``openai`` client over a real local port, over the real engine (scheduler + KV-cache runner) on a
tiny Hugging Face model whose tokenizer has a chat template."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import openai
import pytest
import torch
from grpo_testing.fakes import FakeSteps
from grpo_testing.hf_engine import load_hf_policy, running_engine, serve_on_port
from grpo_testing.hf_models import full_logits
from grpo_testing.inference_apps import inference_app

from megatron.rl.inference.interface import LocalInferenceInterface
from megatron.rl.inference.scheduler import SchedulerConfig
from megatron.rl.models.hf.tokenizer import HuggingFaceTokenizer
from megatron.rl.tokenizer import CharTokenizer
from megatron.rl.wire import ChatCompletionRequest, ChatCompletionResponse

MESSAGES = [
    {"role": "system", "content": "Answer with a number."},
    {"role": "user", "content": "What is 12+7?"},
]
POLICY_VERSION = 5


async def serve(model, tokenizer, work, max_seq_len: int = 64):
    """Run ``await work(base_url)`` against the inference server on a real local port."""
    return await serve_on_port(model, tokenizer, work, max_seq_len, lambda: POLICY_VERSION)


@pytest.fixture
def llama3(single_rank_world, tiny_hf_checkpoints):
    """Our model of the tiny llama3 checkpoint and its tokenizer (BOS in the chat template)."""
    return load_hf_policy(tiny_hf_checkpoints["llama3"])


def test_openai_client_gets_text_per_token_logprobs_and_policy_versions(llama3):
    model, tokenizer = llama3

    async def work(url):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        async with client:
            return await client.chat.completions.create(
                model="policy",
                messages=MESSAGES,
                max_completion_tokens=8,
                temperature=1.0,
                seed=11,
                n=2,
                logprobs=True,
                top_logprobs=0,
                extra_body={"top_k": 0},
            )

    completion = asyncio.run(serve(model, tokenizer, work))
    assert completion.object == "chat.completion" and completion.model == "policy"
    prompt = tokenizer.encode_chat(MESSAGES)
    assert len(completion.choices) == 2
    sampled = []
    for index, choice in enumerate(completion.choices):
        extra = choice.model_extra
        assert choice.index == index and choice.message.role == "assistant"
        assert extra["prompt_token_ids"] == prompt
        assert extra["prompt_text"] == tokenizer.apply_chat_template(MESSAGES)
        tokens = extra["token_ids"]
        assert choice.message.content == tokenizer.decode(tokens)
        assert choice.finish_reason == ("stop" if tokens[-1] == tokenizer.eos_id else "length")
        assert extra["policy_versions"] == [POLICY_VERSION] * len(tokens)
        entries = choice.logprobs.content
        assert [e.token for e in entries] == [tokenizer.decode([t]) for t in tokens]
        assert [e.bytes for e in entries] == [list(e.token.encode()) for e in entries]
        assert all(e.top_logprobs == [] for e in entries)
        # temperature 1, no filtering: each logprob is the model's own, teacher-forced
        ids = torch.tensor([prompt + tokens])  # (1, T)
        logp = torch.log_softmax(full_logits(model, ids, tokenizer.vocab_size)[0], dim=-1)
        expected = [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]
        assert [e.logprob for e in entries] == pytest.approx(expected, abs=1e-4)
        sampled.append(tokens)
    assert sampled[0] != sampled[1]  # samples seeded derive_seed(11, i)
    assert completion.usage.prompt_tokens == len(prompt)
    assert completion.usage.completion_tokens == sum(map(len, sampled))


def test_samples_equal_the_engine_level_requests_and_validate_as_our_wire_model(llama3):
    model, tokenizer = llama3
    body = {"messages": MESSAGES, "max_tokens": 6, "seed": 3, "n": 2, "logprobs": True}

    async def post(url):
        async with httpx.AsyncClient() as client:
            return await client.post(f"{url}/v1/chat/completions", json=body)

    async def in_process():
        async with running_engine(model, tokenizer.vocab_size, tokenizer.eos_id, 4, 64) as engine:
            request = ChatCompletionRequest.model_validate(body).to_inference_request()
            return await LocalInferenceInterface(engine, tokenizer).generate_group(request, 2)

    answer = asyncio.run(serve(model, tokenizer, post))
    assert answer.status_code == 200, answer.text
    served = ChatCompletionResponse.model_validate(answer.json()).to_inference_responses()
    expected = asyncio.run(in_process())
    assert [r.tokens for r in served] == [r.tokens for r in expected]
    assert [r.tokens for r in served][0] != [r.tokens for r in served][1]
    for got, want in zip(served, expected):
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-6)
        assert (got.text, got.prompt_text, got.prompt_tokens) == (
            want.text,
            want.prompt_text,
            want.prompt_tokens,
        )


def test_a_tokenizer_without_a_chat_template_is_a_422_naming_it(
    single_rank_world, tiny_hf_checkpoints, tmp_path
):
    directory = shutil.copytree(tiny_hf_checkpoints["qwen2"], tmp_path / "plain")
    (directory / "chat_template.jinja").unlink()
    assert "chat_template" not in json.loads((directory / "tokenizer_config.json").read_text())
    model, _ = load_hf_policy(directory)
    tokenizer = HuggingFaceTokenizer(directory)

    async def work(url):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        async with client:
            with pytest.raises(openai.UnprocessableEntityError) as info:
                await client.chat.completions.create(model="policy", messages=MESSAGES)
            return info.value

    error = asyncio.run(serve(model, tokenizer, work))
    assert error.status_code == 422
    detail = error.body["detail"] if isinstance(error.body, dict) else str(error.body)
    assert "messages: the tokenizer (HuggingFaceTokenizer) has no chat template" in detail


def post_chat(bodies: list[dict]) -> list[httpx.Response]:
    """POST each body to /v1/chat/completions of an app over a running engine (fake steps) with
    the character tokenizer, which has no chat template."""
    tokenizer = CharTokenizer()

    async def run():
        config = SchedulerConfig(max_requests=4, max_seq_len=24)
        async with inference_app(FakeSteps(), config, tokenizer) as (app, _):
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://trainer"
            ) as client:
                return [await client.post("/v1/chat/completions", json=b) for b in bodies]

    return asyncio.run(run())


USER = [{"role": "user", "content": "1+1="}]


@pytest.mark.parametrize(
    "body, needle",
    [
        pytest.param({"messages": USER, "stop": [""]}, "field 'stop", id="empty-stop"),
        pytest.param(
            {"messages": USER, "tools": [{"type": "code_interpreter"}]},
            "field 'tools.0.type'",
            id="non-function-tool",
        ),
        pytest.param(
            {"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]},
            "field 'tools.0.function.name'",
            id="tool-name",
        ),
        pytest.param(
            {"messages": USER, "tool_choice": "required"},
            "'tool_choice' 'required' needs 'tools'",
            id="required-without-tools",
        ),
        pytest.param(
            {"messages": USER, "tool_choice": "any"}, "field 'tool_choice'", id="tool-choice"
        ),
        pytest.param({"messages": USER, "top_logprobs": 2}, "needs 'logprobs'", id="top-2"),
        pytest.param(
            {"messages": USER, "logprobs": True, "top_logprobs": 21},
            "field 'top_logprobs'",
            id="top-21",
        ),
        pytest.param(
            {"messages": USER, "stream_options": {"include_usage": True}},
            "needs 'stream'",
            id="options-without-stream",
        ),
        pytest.param({"messages": USER, "n": 0}, "field 'n'", id="n-zero"),
        pytest.param(
            {"messages": USER, "max_tokens": 4, "max_completion_tokens": 5},
            "'max_tokens' and 'max_completion_tokens' differ",
            id="two-budgets",
        ),
        pytest.param({"messages": []}, "field 'messages'", id="no-messages"),
        pytest.param({"max_tokens": 3}, "field 'messages'", id="missing-messages"),
        pytest.param(
            {"messages": [{"role": "robot", "content": "x"}]}, "field 'messages.0.role'", id="role"
        ),
        pytest.param(
            {"messages": [{"role": "user", "content": "x", "audio": "a"}]},
            "field 'messages.0.audio'",
            id="message-extra-field",
        ),
        pytest.param(
            {"messages": USER},
            "messages: the tokenizer (CharTokenizer) has no chat template",
            id="no-chat-template",
        ),
    ],
)
def test_bad_chat_requests_are_422_naming_the_problem(body, needle):
    (r,) = post_chat([body])
    assert r.status_code == 422
    assert needle in r.json()["detail"]


def test_a_model_not_served_is_a_404_naming_it_and_the_served_one():
    served, unknown = post_chat(
        [{"messages": USER, "model": "policy"}, {"messages": USER, "model": "gpt-x"}]
    )
    assert served.status_code != 404
    assert unknown.status_code == 404
    assert "the model 'gpt-x' is not served here ('policy')" in unknown.json()["detail"]
