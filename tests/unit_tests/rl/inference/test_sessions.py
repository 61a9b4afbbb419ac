"""Agent sessions (``megatron.rl.inference.sessions``): the engine requests each turn sends, the
conversation checks, and that every session ends in the engine however it ends."""

from __future__ import annotations

import asyncio

import pytest

from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.inference.protocol import InvalidInferenceRequest
from megatron.rl.inference.sessions import (
    SessionError,
    SessionRegistry,
    conversation_suffix,
    session_base_url,
    session_registry,
)
from megatron.rl.seeding import derive_seed
from megatron.rl.wire import (
    ChatMessage,
    InferenceRequest,
    InferenceResponse,
    RolloutKey,
    SamplingParams,
    ToolCall,
    ToolCallFunction,
)

KEY = RolloutKey(batch_id=3, index_in_batch=1, sample_index=2)
SAMPLING = SamplingParams(temperature=0.7, max_tokens=5)
SYSTEM = ChatMessage(role="system", content="be brief")
USER = ChatMessage(role="user", content="2+2?")


class RecordingInference(InferenceInterface):
    """Answers turn t with tokens [100 + t, 101 + t]; records requests and ended rollouts."""

    def __init__(self, invalid_at: int | None = None) -> None:
        self.requests: list[InferenceRequest] = []
        self.ended: list[RolloutKey] = []
        self.invalid_at = invalid_at

    async def generate(self, request: InferenceRequest) -> InferenceResponse:
        self.requests.append(request)
        t = len(self.requests) - 1
        if t == self.invalid_at:
            raise InvalidInferenceRequest("prompt too long")
        prompt = [1, 2] if request.messages is not None else list(request.prompt_tokens) + [9]
        return InferenceResponse(
            prompt_tokens=prompt,
            tokens=[100 + t, 101 + t],
            text=f"answer {t}",
            logprobs=[-0.5, -0.25],
            policy_versions=[t, t],
            finish_reason="stop",
        )

    async def end_rollout(self, key: RolloutKey) -> bool:
        self.ended.append(key)
        return True


def reply(response: InferenceResponse) -> tuple[ChatMessage, int]:
    return ChatMessage(role="assistant", content=response.text), 0


def tool(content: str, call_id: str = "c0") -> ChatMessage:
    return ChatMessage(role="tool", content=content, tool_call_id=call_id)


def open_session(max_turns: int = 3, **kwargs):
    inference = RecordingInference(**kwargs)
    registry = SessionRegistry(inference)
    return inference, registry, registry.open(KEY, 77, SAMPLING, max_turns)


def test_turns_continue_the_generated_tokens_with_the_new_messages_only():
    inference, registry, session = open_session(max_turns=3)

    async def run():
        first = [SYSTEM, USER]
        t0 = await registry.chat(session.token, first, None, None, reply)
        second = [*first, t0.message, tool("4")]
        t1 = await registry.chat(session.token, second, None, 3, reply)
        third = [*second, t1.message, tool("ok", "c1")]
        await registry.chat(session.token, third, None, 50, reply)

    asyncio.run(run())
    r0, r1, r2 = inference.requests
    assert r0.messages == [SYSTEM, USER] and r0.seed == 77 and r0.continued
    assert r0.rollout_key == KEY and r0.sampling == SAMPLING
    assert r1.prompt_tokens == [1, 2, 100, 101] and r1.suffix_messages == [tool("4")]
    assert r1.seed == derive_seed(77, 1) and r1.continued and r1.rollout_key == KEY
    assert r1.sampling.max_tokens == 3 and r1.sampling.temperature == 0.7  # lowered budget
    assert r2.prompt_tokens == [1, 2, 100, 101, 9, 101, 102]
    assert r2.seed == derive_seed(77, 2) and not r2.continued  # the last turn the session allows
    assert r2.sampling.max_tokens == 5  # an agent's larger budget is capped
    assert len(session.turns) == 3 and session.error is None


@pytest.mark.parametrize(
    "edit, status, names",
    [
        pytest.param(
            lambda m: [m[0], m[1], reply_text("edited"), m[3]],
            400,
            "messages.2",
            id="edited-assistant-message",
        ),
        pytest.param(lambda m: [m[0], USER, *m[2:]], 400, "messages.1", id="edited-user-message"),
        pytest.param(lambda m: m[:3], 400, "needs new ones", id="no-new-message"),
        pytest.param(
            lambda m: [*m, reply_text("mine")],
            400,
            "messages.4",
            id="assistant-message-not-generated",
        ),
    ],
)
def test_a_conversation_that_does_not_continue_the_session_is_refused_and_ends_it(
    edit, status, names
):
    inference, registry, session = open_session()

    async def run():
        first = [SYSTEM, ChatMessage(role="user", content="3+3?")]
        t0 = await registry.chat(session.token, first, None, None, reply)
        with pytest.raises(SessionError) as err:
            await registry.chat(
                session.token, edit([*first, t0.message, tool("6")]), None, 4, reply
            )
        assert err.value.status == status and names in str(err.value)
        with pytest.raises(SessionError, match="ended after an error") as again:
            await registry.chat(session.token, [*first, t0.message, tool("6")], None, 4, reply)
        assert again.value.status == 409

    asyncio.run(run())
    assert inference.ended == [KEY]  # the engine no longer waits for turn 1
    assert len(inference.requests) == 1 and session.error is not None


def reply_text(text: str) -> ChatMessage:
    return ChatMessage(role="assistant", content=text)


def test_tool_calls_compare_as_json_values_and_tools_must_not_change():
    call = ToolCall(id="c1", function=ToolCallFunction(name="add", arguments='{"a": 1, "b": 2}'))
    ours = ChatMessage(role="assistant", content="", tool_calls=[call])
    spaced = call.model_copy(
        update={"function": ToolCallFunction(name="add", arguments='{"b":2,"a":1}')}
    )
    theirs = ChatMessage(role="assistant", content=None, tool_calls=[spaced])
    assert conversation_suffix([USER, ours], [USER, theirs, tool("3", "c1")]) == [tool("3", "c1")]
    other = call.model_copy(update={"id": "c2"})
    with pytest.raises(SessionError, match="messages.1"):
        conversation_suffix(
            [USER, ours], [USER, ours.model_copy(update={"tool_calls": [other]}), tool("3")]
        )

    inference, registry, session = open_session()
    tools = [{"type": "function", "function": {"name": "add"}}]

    async def run():
        t0 = await registry.chat(session.token, [USER], tools, None, reply)
        with pytest.raises(SessionError, match="field 'tools'"):
            await registry.chat(session.token, [USER, t0.message, tool("x")], None, None, reply)

    asyncio.run(run())
    assert inference.requests[0].tools == tools and inference.ended == [KEY]


def test_more_turns_than_max_turns_are_refused():
    inference, registry, session = open_session(max_turns=1)

    async def run():
        t0 = await registry.chat(session.token, [USER], None, None, reply)
        assert not inference.requests[0].continued
        with pytest.raises(SessionError, match="allows 1 model turns") as err:
            await registry.chat(session.token, [USER, t0.message, tool("4")], None, None, reply)
        assert err.value.status == 409
        await registry.close(session.token)

    asyncio.run(run())
    assert inference.ended == []  # the only turn was sent without continued: nothing awaited


def test_closing_ends_the_awaited_turn_once_and_forgets_the_token():
    inference, registry, session = open_session()

    async def run():
        await registry.chat(session.token, [USER], None, None, reply)
        await registry.close(session.token)
        with pytest.raises(SessionError) as err:
            await registry.chat(session.token, [USER], None, None, reply)
        assert err.value.status == 404
        with pytest.raises(KeyError):
            await registry.close(session.token)

    asyncio.run(run())
    assert inference.ended == [KEY] and session.closed


def test_a_session_without_a_turn_sends_a_one_token_stand_in_under_its_key():
    inference, registry, session = open_session()
    asyncio.run(registry.close(session.token))
    (stand_in,) = inference.requests
    assert stand_in.rollout_key == KEY and stand_in.prompt_tokens == [0]
    assert stand_in.sampling.max_tokens == 1 and not stand_in.continued
    assert inference.ended == []


def test_an_unusable_first_turn_is_a_422_and_the_stand_in_still_arrives():
    inference, registry, session = open_session(invalid_at=0)

    async def run():
        with pytest.raises(SessionError) as err:
            await registry.chat(session.token, [USER], None, None, reply)
        assert err.value.status == 422 and "too long" in str(err.value)
        await registry.close(session.token)

    asyncio.run(run())
    assert len(inference.requests) == 2 and inference.requests[1].prompt_tokens == [0]


def test_an_unusable_later_turn_ends_the_session_without_end_rollout():
    """The engine stopped waiting when the invalid turn arrived (``LocalInferenceInterface``)."""
    inference, registry, session = open_session(invalid_at=1)

    async def run():
        t0 = await registry.chat(session.token, [USER], None, None, reply)
        with pytest.raises(SessionError) as err:
            await registry.chat(session.token, [USER, t0.message, tool("4")], None, None, reply)
        assert err.value.status == 422
        await registry.close(session.token)

    asyncio.run(run())
    assert inference.ended == [] and len(inference.requests) == 2


def test_registry_per_interface_and_base_url():
    a, b = RecordingInference(), RecordingInference()
    assert session_registry(a) is session_registry(a) is not session_registry(b)
    assert session_base_url("http://h:1/", "tok") == "http://h:1/sessions/tok/v1"
    with pytest.raises(ValueError, match="max_turns"):
        session_registry(a).open(KEY, 0, SAMPLING, 0)
