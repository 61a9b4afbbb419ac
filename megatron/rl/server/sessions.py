"""The inference server's agent-session routes: one OpenAI base URL per rollout.

``install_session_routes(app, inference, tokenizer)`` serves, for every open session of
``session_registry(inference)`` (``megatron.rl.inference.sessions``):

* ``POST /sessions/{token}/v1/chat/completions``: the session's next turn. The body is
  ``wire.ChatCompletionRequest`` (what the ``openai`` client sends); ``n`` must be 1 and the
  RL extensions ``rollout_key`` and ``ignore_eos`` are refused (the session has its own); the
  sampling parameters are the session's (``temperature``, ``top_p``, ``top_k``, ``seed`` are
  ignored) and ``max_tokens`` only lowers its budget. ``tools`` are rendered by the chat template
  and must be the same on every turn; the model's tool calls are parsed out of its text as on
  ``/v1/chat/completions`` (``chat_responses``), and the agent echoes the assistant message with
  its ``tool_calls`` in the next turn's messages. A conversation that does not continue the
  session is a 400 naming the message, a finished or failed session a 409, an unknown token a
  404; each of them ends the session.
* ``GET /sessions/{token}/v1/models``: the served model, as ``GET /v1/models``.

Every session route needs the session's own credential, ``Authorization: Bearer
<session.credential>`` (401 otherwise; the session stays open): the agent's ``api_key``. It opens
this session only; the job's key is not needed here and the session credential opens nothing else
(another session, ``/v1/...``, ``/v1/rollouts/end``). So an agent written against the ``openai``
package works unchanged with ``OpenAI(base_url=f"{server}/sessions/{token}/v1",
api_key=session.credential)``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import FastAPI, HTTPException, Request

from megatron.rl.inference.interface import InferenceInterface, StreamEvent, TokenDelta
from megatron.rl.inference.protocol import EngineError
from megatron.rl.inference.sessions import SESSIONS_PREFIX, SessionError, session_registry
from megatron.rl.server.chat_responses import chat_completion_response
from megatron.rl.server.http import ERROR_RESPONSES
from megatron.rl.server.streaming import ChatChunks, EventStream, sse_events
from megatron.rl.tokenizer import Tokenizer
from megatron.rl.tools.parsers import ToolCallParser
from megatron.rl.wire import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    InferenceResponse,
    ModelCard,
    ModelList,
)

T = TypeVar("T")


def install_session_routes(
    app: FastAPI,
    inference: InferenceInterface,
    tokenizer: Tokenizer,
    model_name: str = "policy",
    parser: ToolCallParser | None = None,
) -> None:
    """Add the session routes (module docstring) for the sessions of ``inference``; ``parser``
    parses the model's tool calls as on ``/v1/chat/completions`` (None: never)."""
    registry = session_registry(inference)
    registry.served = True
    ids = itertools.count()

    def authorized(token: str, http: Request) -> None:
        """401 unless the request carries session ``token``'s credential (404: no session)."""
        session = _check(lambda: registry.get(token))
        if not session.admits(http.headers.get("authorization", "")):
            raise HTTPException(
                401,
                "session: missing or wrong session credential (Authorization: Bearer <the "
                "session's api_key>)",
                headers={"WWW-Authenticate": "Bearer"},
            )

    @app.get(
        SESSIONS_PREFIX + "/{token}/v1/models", response_model=ModelList, responses=ERROR_RESPONSES
    )
    async def session_models(token: str, http: Request) -> ModelList:
        """The model the session generates with."""
        authorized(token, http)
        return ModelList(data=[ModelCard(id=model_name, created=0, owned_by="megatron-rl")])

    @app.post(
        SESSIONS_PREFIX + "/{token}/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**ERROR_RESPONSES, 404: ERROR_RESPONSES[422], 409: ERROR_RESPONSES[422]},
    )
    async def session_chat(token: str, body: ChatCompletionRequest, http: Request) -> Any:
        """The session's next assistant turn for the agent's conversation (streamed: the same
        tokens, sent as they come; a client that leaves does not end the turn)."""
        authorized(token, http)
        refused = _refused_field(body, parser)
        if refused is not None:
            _check(lambda: registry.get(token))
            await registry.fail(token, refused)
            raise HTTPException(400, f"session: {refused}")
        answers: list[ChatCompletionResponse] = []

        def reply(out: InferenceResponse) -> tuple[ChatMessage, int]:
            """The answer's assistant message, as the agent will echo it."""
            answer = chat_completion_response(
                body,
                [out],
                tokenizer,
                parser,
                response_id=f"chatcmpl-s{next(ids)}",
                model=model_name,
            )
            answers.append(answer)
            choice = answer.choices[0]
            message = choice.message
            echoed = ChatMessage(
                role="assistant", content=message.content, tool_calls=message.tool_calls
            )
            return echoed, choice.tool_call_errors

        max_tokens = body.max_completion_tokens or body.max_tokens
        tools = body.tool_schemas()
        if not body.stream:
            await _answered(registry.chat(token, body.messages, tools, max_tokens, reply))
            return answers[-1]
        outs: list[InferenceResponse] = []
        queue: asyncio.Queue[TokenDelta | None] = asyncio.Queue()

        def record(out: InferenceResponse) -> tuple[ChatMessage, int]:
            outs.append(out)
            return reply(out)

        turn = asyncio.ensure_future(
            _answered(
                registry.chat(token, body.messages, tools, max_tokens, record, queue.put_nowait)
            )
        )
        turn.add_done_callback(lambda _: queue.put_nowait(None))
        first = await queue.get()
        if first is None:
            await turn  # the refusal, as its status
        chunks = ChatChunks(body, tokenizer, parser, f"chatcmpl-s{next(ids)}", model_name)
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStream(sse_events(chunks, _turn_events(first, queue, turn, outs), usage))


async def _answered(work: Awaitable[T]) -> T:
    """``work``'s result; a session's refusal and the engine's failure as statuses."""
    try:
        return await work
    except SessionError as exc:
        raise HTTPException(exc.status, f"session: {exc}") from None
    except EngineError as exc:
        raise HTTPException(503, f"inference engine unavailable: {exc}") from None


async def _turn_events(
    first: TokenDelta | None,
    queue: asyncio.Queue[TokenDelta | None],
    turn: asyncio.Future,
    outs: list[InferenceResponse],
) -> AsyncIterator[tuple[int, StreamEvent]]:
    """The streamed events of a session's turn: its token deltas, then its response. The turn
    is the trainer's (a keyed rollout): closing this iterator early waits for it to finish
    instead of cancelling it, as for an answer that was not streamed."""
    try:
        delta = first
        while delta is not None:
            yield 0, delta
            delta = await queue.get()
        await turn
        yield 0, outs[-1]
    finally:
        await asyncio.gather(asyncio.shield(turn), return_exceptions=True)


def _refused_field(body: ChatCompletionRequest, parser: ToolCallParser | None) -> str | None:
    """Why a session refuses ``body`` (naming the field), or None."""
    if body.n != 1:
        return "field 'n': a session generates one sample per request (n=1)"
    if body.stop is not None or body.top_logprobs:
        return (
            "fields 'stop' and 'top_logprobs': a session's turns are rollout turns, ended by the "
            "environment's stop tokens, with their tokens' logprobs only"
        )
    if body.rollout_key is not None:
        return "field 'rollout_key': a session's requests carry the session's rollout key"
    if body.ignore_eos:
        return "field 'ignore_eos': a session's sampling parameters are the environment's"
    if parser is None and body.effective_tool_choice not in ("none", "auto"):
        return "field 'tool_choice': this server parses no tool calls; give 'auto' or 'none'"
    return None


def _check(get):
    try:
        return get()
    except SessionError as exc:
        raise HTTPException(exc.status, f"session: {exc}") from None
