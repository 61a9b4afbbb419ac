"""The session routes (``/sessions/{token}/v1``) through the ``openai`` client: tool calls parsed
and echoed back, the next turn sent as the new messages only, and the refusals."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.inference.sessions import session_base_url, session_registry
from megatron.rl.server.inference_server import create_inference_app
from megatron.rl.tokenizer import CharTokenizer
from megatron.rl.wire import InferenceRequest, InferenceResponse, RolloutKey, SamplingParams

CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
KEY = RolloutKey(batch_id=0, index_in_batch=0, sample_index=0)


class ToolCallingInference(InferenceInterface):
    """Turn 0 writes a hermes tool call, later turns plain text; records the requests."""

    def __init__(self) -> None:
        self.requests: list[InferenceRequest] = []

    async def generate(self, request: InferenceRequest) -> InferenceResponse:
        self.requests.append(request)
        text = CALL if request.messages is not None else "3"
        prompt = [5, 6] if request.messages is not None else [*request.prompt_tokens, 7]
        return InferenceResponse(
            prompt_tokens=prompt,
            tokens=[8, 9],
            text=text,
            logprobs=[-1.0, -1.0],
            policy_versions=[0, 0],
            finish_reason="stop",
        )


def run(work):
    inference = ToolCallingInference()
    app = create_inference_app(inference, CharTokenizer("0123456789"), tool_call_parser="hermes")
    registry = session_registry(inference)
    session = registry.open(KEY, 1, SamplingParams(max_tokens=4), 3)

    async def main():
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport) as http:
            client = openai.AsyncOpenAI(
                base_url=session_base_url("http://test", session.token),
                api_key=session.credential,
                http_client=http,
                max_retries=0,
            )
            return await work(client, session)

    return asyncio.run(main()), inference, session


def test_tool_calls_are_returned_and_the_echoed_conversation_continues():
    async def work(client, session):
        messages = [{"role": "user", "content": "1+2?"}]
        first = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and message.content is None
        (call,) = message.tool_calls
        assert call.function.name == "add" and call.function.arguments == '{"a": 1, "b": 2}'
        messages += [
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "3"},
        ]
        second = await client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, max_tokens=2
        )
        return second

    second, inference, session = run(work)
    assert second.choices[0].message.content == "3"
    assert second.choices[0].model_extra["prompt_token_ids"] == [5, 6, 8, 9, 7]
    r0, r1 = inference.requests
    assert r0.tools == TOOLS and r1.tools == TOOLS and r1.sampling.max_tokens == 2
    assert r1.prompt_tokens == [5, 6, 8, 9] and [m.role for m in r1.suffix_messages] == ["tool"]
    assert len(session.turns) == 2 and session.error is None


@pytest.mark.parametrize(
    "kwargs, status, words",
    [
        pytest.param({"n": 2}, 400, "field 'n'", id="n"),
        pytest.param({"extra_body": {"ignore_eos": True}}, 400, "field 'ignore_eos'", id="eos"),
    ],
)
def test_refused_fields_end_the_session(kwargs, status, words):
    async def work(client, session):
        with pytest.raises(openai.APIStatusError) as err:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "1"}], **kwargs
            )
        return err.value

    error, inference, session = run(work)
    assert error.status_code == status and words in error.response.json()["detail"]
    assert session.error is not None
    (stand_in,) = inference.requests  # turn 0 never came: its one-token stand-in did
    assert stand_in.prompt_tokens == [0] and stand_in.rollout_key == KEY


def test_an_unknown_session_is_a_404():
    async def work(client, session):
        bad = client.with_options(base_url=session_base_url("http://test", "nope"))
        with pytest.raises(openai.NotFoundError) as err:
            await bad.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "1"}]
            )
        models = await client.models.list()
        return err.value, models

    (error, models), _, _ = run(work)
    assert "no open session" in error.response.json()["detail"]
    assert [m.id for m in models.data] == ["policy"]


JOB_KEY = "the-jobs-key"


def test_a_session_credential_opens_its_own_session_and_nothing_else():
    """Least privilege for agents: the credential an agent gets opens its session; a wrong or
    another session's credential is a 401 that leaves the session open; the raw endpoints of a
    keyed server refuse it; the job's key is not what a session asks for."""
    inference = ToolCallingInference()
    app = create_inference_app(
        inference, CharTokenizer("0123456789"), tool_call_parser="hermes", api_key=JOB_KEY
    )
    registry = session_registry(inference)
    mine = registry.open(KEY, 1, SamplingParams(max_tokens=4), 3)
    other = registry.open(KEY.model_copy(update={"sample_index": 1}), 2, SamplingParams(), 3)
    chat = {"model": "m", "messages": [{"role": "user", "content": "1+2?"}]}

    async def main():
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:

            def post(path, body, credential):
                return http.post(path, json=body, headers={"authorization": f"Bearer {credential}"})

            mine_path = f"/sessions/{mine.token}/v1/chat/completions"
            other_path = f"/sessions/{other.token}/v1/chat/completions"
            return {
                "other session": await post(other_path, chat, mine.credential),
                "job key on a session": await post(mine_path, chat, JOB_KEY),
                "no credential": await http.post(mine_path, json=chat),
                "raw completions": await post("/v1/completions", {"prompt": "1"}, mine.credential),
                "end another rollout": await post(
                    "/v1/rollouts/end", {"rollout_key": other.key.model_dump()}, mine.credential
                ),
                "own session": await post(mine_path, chat, mine.credential),
            }

    answers = asyncio.run(main())
    assert {name: r.status_code for name, r in answers.items()} == {
        "other session": 401,
        "job key on a session": 401,
        "no credential": 401,
        "raw completions": 401,
        "end another rollout": 401,
        "own session": 200,
    }
    assert mine.credential not in answers["other session"].text
    assert len(inference.requests) == 1  # only the own session generated
    assert other.error is None and not other.closed  # a refused credential ends nothing


def test_a_streamed_session_turn_is_the_turn_not_streamed():
    async def turns(client, stream: bool):
        messages = [{"role": "user", "content": "1+2?"}]
        first = await client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, stream=stream
        )
        if stream:
            chunks = [chunk.choices[0] async for chunk in first]
            piece_head, piece_args = [p for c in chunks for p in c.delta.tool_calls or ()]
            call = {"id": piece_head.id, "type": "function"}
            call["function"] = {
                "name": piece_head.function.name,
                "arguments": piece_args.function.arguments,
            }
            message = {"role": "assistant", "tool_calls": [call]}
            assert chunks[-1].finish_reason == "tool_calls"
        else:
            message = first.choices[0].message.model_dump(exclude_none=True)
        messages += [message, {"role": "tool", "tool_call_id": "call_0", "content": "3"}]
        second = await client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, stream=stream
        )
        if stream:
            return "".join([c.choices[0].delta.content or "" async for c in second])
        return second.choices[0].message.content

    async def streamed(client, session):
        return await turns(client, True)

    async def whole(client, session):
        return await turns(client, False)

    text, streamed_inference, _ = run(streamed)
    expected, whole_inference, _ = run(whole)
    assert text == expected == "3"
    assert streamed_inference.requests == whole_inference.requests  # the trainer's tokens
