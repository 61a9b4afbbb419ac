"""The inference server's agent-session routes: one OpenAI base URL per rollout.

``install_session_routes(app, inference, tokenizer)`` serves, for every open session of
``session_registry(inference)`` (``megatron.rl.inference.sessions``):

* ``POST /sessions/{token}/v1/chat/completions``: the session's next turn. The body is
  ``wire_chat.ChatCompletionRequest`` (what the ``openai`` client sends); ``n`` must be 1 and the
  RL extensions ``rollout_key`` and ``ignore_eos`` are refused (the session has its own); the
  sampling parameters are the session's (``temperature``, ``top_p``, ``top_k``, ``seed`` are
  ignored) and ``max_tokens`` only lowers its budget. A conversation that does not continue the
  session is a 400 naming the message, a finished or failed session a 409, an unknown token a
  404; each of them ends the session.
* ``GET /sessions/{token}/v1/models``: the served model, as ``GET /v1/models``.

So an agent written against the ``openai`` package works unchanged with
``OpenAI(base_url=f"{server}/sessions/{token}/v1", api_key=...)``.
"""

from __future__ import annotations

import itertools
import time

from fastapi import FastAPI, HTTPException

from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.inference.protocol import EngineError
from megatron.rl.inference.sessions import (
    SESSIONS_PREFIX,
    SessionError,
    SessionTurn,
    session_registry,
)
from megatron.rl.server.http import ERROR_RESPONSES
from megatron.rl.wire import ChatMessage, InferenceResponse
from megatron.rl.wire_chat import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatTokenLogprob,
)
from megatron.rl.wire_completions import CompletionUsage, ModelCard, ModelList


def install_session_routes(
    app: FastAPI, inference: InferenceInterface, tokenizer, model_name: str = "policy"
) -> None:
    """Add the session routes (module docstring) for the sessions of ``inference``."""
    registry = session_registry(inference)
    registry.served = True
    ids = itertools.count()

    @app.get(
        SESSIONS_PREFIX + "/{token}/v1/models", response_model=ModelList, responses=ERROR_RESPONSES
    )
    async def session_models(token: str) -> ModelList:
        """The model the session generates with."""
        _check(lambda: registry.get(token))
        return ModelList(data=[ModelCard(id=model_name, created=0, owned_by="megatron-rl")])

    @app.post(
        SESSIONS_PREFIX + "/{token}/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**ERROR_RESPONSES, 404: ERROR_RESPONSES[422], 409: ERROR_RESPONSES[422]},
    )
    async def session_chat(token: str, body: ChatCompletionRequest) -> ChatCompletionResponse:
        """The session's next assistant turn for the agent's conversation."""
        refused = _refused_field(body)
        if refused is not None:
            _check(lambda: registry.get(token))
            await registry.fail(token, refused)
            raise HTTPException(400, f"session: {refused}")
        max_tokens = body.max_completion_tokens or body.max_tokens
        try:
            turn = await registry.chat(token, body.messages, None, max_tokens, assistant_message)
        except SessionError as exc:
            raise HTTPException(exc.status, f"session: {exc}") from None
        except EngineError as exc:
            raise HTTPException(503, f"inference engine unavailable: {exc}") from None
        return ChatCompletionResponse(
            id=f"chatcmpl-session-{next(ids)}",
            created=int(time.time()),
            model=body.model or model_name,
            choices=[_choice(tokenizer, turn, body.logprobs)],
            usage=_usage(turn.response),
        )


def assistant_message(response: InferenceResponse) -> ChatMessage:
    """The assistant message an agent is answered with: the generated text."""
    return ChatMessage(role="assistant", content=response.text)


def _refused_field(body: ChatCompletionRequest) -> str | None:
    """Why a session refuses ``body`` (naming the field), or None."""
    if body.n != 1:
        return "field 'n': a session generates one sample per request (n=1)"
    if body.rollout_key is not None:
        return "field 'rollout_key': a session's requests carry the session's rollout key"
    if body.ignore_eos:
        return "field 'ignore_eos': a session's sampling parameters are the environment's"
    return None


def _check(get):
    try:
        return get()
    except SessionError as exc:
        raise HTTPException(exc.status, f"session: {exc}") from None


def _choice(tokenizer, turn: SessionTurn, logprobs: bool) -> ChatCompletionChoice:
    out = turn.response
    content = None
    if logprobs:
        content = ChatChoiceLogprobs(
            content=[
                ChatTokenLogprob(token=p, logprob=lp, bytes=list(p.encode("utf-8")))
                for p, lp in zip((tokenizer.decode([t]) for t in out.tokens), out.logprobs)
            ]
        )
    return ChatCompletionChoice(
        message=ChatCompletionMessage(content=turn.message.content),
        finish_reason=out.finish_reason,
        logprobs=content,
        token_ids=out.tokens,
        prompt_token_ids=out.prompt_tokens,
        policy_versions=out.policy_versions,
        prompt_text=out.prompt_text or "",
    )


def _usage(out: InferenceResponse) -> CompletionUsage:
    return CompletionUsage(
        prompt_tokens=len(out.prompt_tokens),
        completion_tokens=len(out.tokens),
        total_tokens=len(out.prompt_tokens) + len(out.tokens),
    )
