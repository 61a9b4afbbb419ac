"""Agent sessions: an OpenAI-client agent's rollout, assembled from what the engine generated.

An agent written against the ``openai`` package gets a base URL per rollout,
``<inference server>/sessions/<token>/v1`` (``megatron.rl.server.sessions`` serves it). Every chat
completion it asks for there is one turn of one rollout: the session knows the rollout's key,
seed, sampling parameters and budget, and every turn generated so far, so

* turn 0 renders the agent's messages (and tools) with the chat template;
* turn t > 0 must extend the conversation token-exactly: the agent's messages start with the
  previous request's messages and the assistant messages the session returned (compared field by
  field; a mismatch is a ``SessionError`` naming the message index), followed by new non-assistant
  messages (tool results, user replies). Only those are rendered
  (``InferenceRequest.suffix_messages``, ``chat_continuation.environment_tokens``) after the
  previous prompt and generated tokens, so nothing the model generated is re-tokenized;
* turn t has seed ``derive_seed(first_seed, t)`` and the rollout key, and is sent with
  ``continued=True`` (except the ``max_turns``-th), so the deterministic schedule waits for the
  agent's next turn as for ``MultiTurnEnvironment``'s (``multi_turn.py``).

The batch's sampling parameters are the session's: an agent's ``temperature``, ``top_p`` and
``seed`` are ignored, and its ``max_tokens`` only lowers the session's per-turn budget.

``close`` ends the session: the engine stops waiting for another turn (``end_rollout``), and a
rollout whose turn 0 never arrived sends a one-token stand-in request under its key, so the
announced request arrives and the barrier never waits for it. Every error (a protocol violation,
an unusable request) ends the session at once the same way and is kept as ``Session.error``: the
environment turns such a rollout into a placeholder.
"""

from __future__ import annotations

import json
import secrets
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron.rl.inference.interface import (
    InferenceInterface,
    TokenDelta,
    streamed_response,
    turn_request,
)
from megatron.rl.inference.protocol import EngineError, InvalidInferenceRequest
from megatron.rl.wire import (
    ChatMessage,
    InferenceRequest,
    InferenceResponse,
    RolloutKey,
    SamplingParams,
)

SESSIONS_PREFIX = "/sessions"
"""Session base URLs are ``<server>{SESSIONS_PREFIX}/<token>/v1``."""


def session_base_url(server_url: str, token: str) -> str:
    """The OpenAI base URL of session ``token`` on the inference server at ``server_url``."""
    return f"{server_url.rstrip('/')}{SESSIONS_PREFIX}/{token}/v1"


class SessionError(Exception):
    """A request a session refuses; ``status`` is the HTTP status the server answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class SessionTurn:
    """One generated turn: the engine's response and the assistant message the agent got."""

    response: InferenceResponse
    message: ChatMessage
    tool_errors: int = 0
    """Tool calls the model attempted that the agent did not get as calls (malformed ones)."""


@dataclass
class Session:
    """One rollout's conversation (see the module docstring)."""

    token: str
    key: RolloutKey
    seed: int
    """The rollout's first seed: turn t samples with ``derive_seed(seed, t)``."""
    sampling: SamplingParams
    max_turns: int
    tools: list[dict[str, Any]] | None = None
    """The tools of turn 0; later turns must send the same."""
    conversation: list[ChatMessage] = field(default_factory=list)
    """The last request's messages and the assistant message generated for it."""
    turns: list[SessionTurn] = field(default_factory=list)
    error: str | None = None
    """The first error; the session is over once it is set."""
    closed: bool = False
    busy: bool = False
    """A turn is being generated."""
    awaited: bool = False
    """The engine waits for another turn (the last one was sent with ``continued``)."""
    stand_in_sent: bool = False
    """The one-token stand-in of a turn 0 that never arrived was sent."""
    credential: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    """The bearer token that opens this session's routes (the agent's ``api_key``), and
    nothing else."""

    def admits(self, authorization: str) -> bool:
        """Whether an ``Authorization`` header carries this session's credential (compared in
        constant time)."""
        scheme, _, given = authorization.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(
            given.encode(), self.credential.encode()
        )

    def next_request(
        self,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]] | None,
        max_tokens: int | None,
    ) -> InferenceRequest:
        """The engine request of the next turn; ``SessionError`` (4xx) when the agent's messages
        or tools do not continue the session (the message names the index or the field)."""
        turn = len(self.turns)
        if turn >= self.max_turns:
            raise SessionError(409, f"the session allows {self.max_turns} model turns")
        if turn > 0 and tools != self.tools:
            raise SessionError(400, "field 'tools': differs from the session's first request")
        budget = self.sampling.max_tokens if max_tokens is None else max_tokens
        sampling = self.sampling.model_copy(
            update={"max_tokens": min(budget, self.sampling.max_tokens)}
        )
        new, last = messages, None
        if turn > 0:
            new, last = conversation_suffix(self.conversation, messages), self.turns[-1].response
        return turn_request(
            new,
            last,
            turn=turn,
            max_turns=self.max_turns,
            sampling=sampling,
            seed=self.seed,
            key=self.key,
            tools=tools,
        )

    def record(self, messages: list[ChatMessage], turn: SessionTurn) -> None:
        """Add a generated turn (its request's messages, and what the agent was answered)."""
        self.conversation = [*messages, turn.message]
        self.turns.append(turn)


def conversation_suffix(known: list[ChatMessage], messages: list[ChatMessage]) -> list[ChatMessage]:
    """The messages after ``known`` in ``messages``: ``SessionError`` (400) naming the first
    message that differs from the session's, or a new message that is an assistant's."""
    for index, (ours, theirs) in enumerate(zip(known, messages)):
        if not same_message(ours, theirs):
            what = "the assistant message generated" if ours.role == "assistant" else "message"
            raise SessionError(
                400,
                f"field 'messages.{index}': differs from {what} at that place in this session "
                f"(role {ours.role!r}); a session's conversation only grows",
            )
    new = messages[len(known) :]
    if not new:
        raise SessionError(
            400,
            f"field 'messages': the session's conversation has {len(known)} messages; the next "
            "turn needs new ones after them (tool results, a user reply)",
        )
    for offset, message in enumerate(new):
        if message.role == "assistant":
            raise SessionError(
                400,
                f"field 'messages.{len(known) + offset}': an assistant message the model did not "
                "generate in this session",
            )
    return new


def same_message(a: ChatMessage, b: ChatMessage) -> bool:
    """Whether two messages are the same (tool-call arguments compared as JSON values)."""
    if (a.role, a.content, a.tool_call_id, a.name) != (b.role, b.content, b.tool_call_id, b.name):
        return False
    calls_a, calls_b = a.tool_calls or [], b.tool_calls or []
    if len(calls_a) != len(calls_b):
        return False
    return all(
        (x.id, x.function.name) == (y.id, y.function.name)
        and _json(x.function.arguments) == _json(y.function.arguments)
        for x, y in zip(calls_a, calls_b)
    )


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


Reply = Callable[[InferenceResponse], tuple[ChatMessage, int]]
"""The assistant message an agent is answered with for a generated turn (its text, or the tool
calls parsed out of it), and the number of malformed tool calls in it."""


class SessionRegistry:
    """The open sessions of one ``InferenceInterface``: token -> ``Session``.

    Lives in the event loop of the engine; the server's session routes and the environment that
    opens sessions share it through ``session_registry(inference)``.
    """

    def __init__(self, inference: InferenceInterface) -> None:
        self.inference = inference
        self.sessions: dict[str, Session] = {}
        self.served = False
        """True once a server routes ``/sessions/...`` to this registry."""

    def open(self, key: RolloutKey, seed: int, sampling: SamplingParams, max_turns: int) -> Session:
        """A new session for rollout ``key``; its token is unguessable."""
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        session = Session(secrets.token_urlsafe(16), key, seed, sampling, max_turns)
        self.sessions[session.token] = session
        return session

    def get(self, token: str) -> Session:
        """The open session ``token``; ``SessionError`` 404 if there is none."""
        session = self.sessions.get(token)
        if session is None:
            raise SessionError(404, "no open session has this token (ended or never opened)")
        return session

    async def chat(
        self,
        token: str,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]] | None,
        max_tokens: int | None,
        reply: Reply,
        emit: Callable[[TokenDelta], None] | None = None,
    ) -> SessionTurn:
        """Generate the next turn of session ``token`` for the agent's ``messages``; ``emit``
        (a streamed answer) sees each token as it is generated (the tokens are the same).

        Raises ``SessionError`` for a request the session refuses (the session then ends), and
        ``EngineError`` when the engine failed.
        """
        session = self.get(token)
        if session.error is not None:
            raise SessionError(409, f"the session ended after an error: {session.error}")
        if session.busy:
            raise SessionError(409, "a turn of this session is being generated; wait for it")
        session.busy = True
        try:
            try:
                request = session.next_request(messages, tools, max_tokens)
                if not session.turns:
                    session.tools = tools
                if emit is None:
                    response = await self.inference.generate(request)
                else:
                    response = await streamed_response(self.inference, request, emit)
                turn = SessionTurn(response, *reply(response))
            except (SessionError, InvalidInferenceRequest) as exc:
                status = exc.status if isinstance(exc, SessionError) else 422
                session.awaited = session.awaited and not isinstance(exc, InvalidInferenceRequest)
                await self._fail(session, str(exc))
                raise SessionError(status, str(exc)) from None
            session.record(messages, turn)
            session.awaited = request.continued
            if session.closed:  # the agent gave up while this turn was generated
                await self._release(session)
            return turn
        finally:
            session.busy = False

    async def close(self, token: str) -> Session:
        """End session ``token`` (idempotent) and return it: the engine stops waiting for it."""
        session = self.sessions.pop(token, None)
        if session is None:
            raise KeyError(token)
        session.closed = True
        if not session.busy:
            await self._release(session)
        return session

    async def fail(self, token: str, error: str) -> None:
        """End open session ``token`` with ``error`` (a request the server refused)."""
        await self._fail(self.get(token), error)

    async def _fail(self, session: Session, error: str) -> None:
        session.error = session.error or error
        await self._release(session)

    async def _release(self, session: Session) -> None:
        """Nothing more of the session reaches the engine: end its awaited turn, or send the
        stand-in for a turn 0 that never arrived (its generation is discarded)."""
        if session.awaited:
            session.awaited = False
            await self.inference.end_rollout(session.key)
        elif not session.turns and not session.stand_in_sent:
            session.stand_in_sent = True
            stand_in = InferenceRequest(
                prompt_tokens=[0],
                sampling=session.sampling.model_copy(update={"max_tokens": 1}),
                seed=session.seed,
                rollout_key=session.key,
            )
            try:
                await self.inference.generate(stand_in)
            except (InvalidInferenceRequest, EngineError):
                pass  # it arrived (the barrier counts it) or the engine is gone


_registries: weakref.WeakKeyDictionary[InferenceInterface, SessionRegistry] = (
    weakref.WeakKeyDictionary()
)


def session_registry(inference: InferenceInterface) -> SessionRegistry:
    """The session registry of ``inference`` (made on first use)."""
    registry = _registries.get(inference)
    if registry is None:
        registry = _registries[inference] = SessionRegistry(inference)
    return registry
