"""The trainer's inference server: remote environments generate through the trainer's engine.

``create_inference_app(inference, tokenizer)`` exposes an ``InferenceInterface`` (in the trainer:
the ``LocalInferenceInterface`` over the engine that serves local agents too) as a subset of the
OpenAI completions API: ``POST /v1/completions`` (``wire.CompletionRequest``) and
``POST /v1/chat/completions`` (``wire.ChatCompletionRequest``; the messages are rendered by
the tokenizer's chat template, and a tokenizer without one answers 422 naming it; ``tools`` are
rendered by the template and the model's tool calls parsed out of its text by the
``tool_call_parser``, see ``chat_responses``), plus ``GET /v1/models`` (the one model served,
``model_name``, in OpenAI's list format), ``GET /metrics`` (running tool-call counts,
``wire.ToolCallMetrics``) and one OpenAI base URL per agent session,
``/sessions/{token}/v1`` (``sessions.py``). Requests go
into the same engine queue as local ones, so they belong to the same batches, follow the same
forced-lag schedule and return the same per-token logprobs and policy versions.

Outside requests (no rollout key) are bounded (``limits.py``): the body size (413), ``n`` x
``max_tokens`` (422), the requests in flight per client address (429); a client that disconnects
cancels its generation, whose slot the engine frees at its next step.

Note that the trainer's event loop, and with it this server, only runs while the trainer waits
for a batch; a request sent during a training step is answered when the next window opens.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping

from fastapi import FastAPI, HTTPException, Request

from megatron.rl.auth import require_api_key
from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.inference.protocol import EngineError, InvalidInferenceRequest
from megatron.rl.inference.sessions import SESSIONS_PREFIX
from megatron.rl.server.chat_responses import (
    ToolCallCounter,
    chat_completion_response,
)
from megatron.rl.server.http import ERROR_RESPONSES, install_error_handlers
from megatron.rl.server.limits import BodyLimit, ClientSlots, ServerLimits, unless_disconnected
from megatron.rl.server.sessions import install_session_routes
from megatron.rl.tokenizer import Tokenizer
from megatron.rl.tools.parsers import AUTO, resolve_tool_call_parser
from megatron.rl.wire import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionUsage,
    EndRolloutRequest,
    EndRolloutResponse,
    InferenceRequest,
    InferenceResponse,
    ModelCard,
    ModelList,
    ToolCallMetrics,
    choice_extensions,
)


def create_inference_app(
    inference: InferenceInterface,
    tokenizer: Tokenizer,
    model_name: str = "policy",
    api_key: str | None = None,
    tool_call_parser: str = AUTO,
    adapters: Mapping[str, InferenceInterface] | None = None,
    limits: ServerLimits = ServerLimits(),
) -> FastAPI:
    """A FastAPI app with ``GET /health``, ``GET /metrics``, ``GET /v1/models``,
    ``POST /v1/completions``, ``POST /v1/chat/completions`` and ``POST /v1/rollouts/end`` over
    ``inference``; with ``api_key`` every request needs it as a bearer token (401 otherwise).
    ``tool_call_parser``: a parser name, ``auto`` (the tokenizer's chat template decides) or
    ``none`` (``ValueError`` for another).

    ``adapters`` (a multi-adapter server): further models by name, each generating with its
    named LoRA adapter set; a request's ``model`` picks one, ``model_name`` (or no model) is
    ``inference``'s, any other name is answered 404 naming the models served. Without
    ``adapters`` every request is ``inference``'s, whatever model it names. ``limits``: what
    one outside request and one client may take (``limits.py``)."""
    parser = resolve_tool_call_parser(tool_call_parser, getattr(tokenizer, "chat_template", None))
    counter = ToolCallCounter()
    app = FastAPI(title="megatron-rl inference server", version="1")
    install_error_handlers(app)
    require_api_key(app, api_key, exempt_prefix=SESSIONS_PREFIX + "/")  # sessions: their own
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    slots = ClientSlots(limits.max_requests_per_client)
    ids = itertools.count()
    created = int(time.time())
    by_name = dict(adapters or {})
    served = [
        ModelCard(id=name, created=created, owned_by="megatron-rl")
        for name in (model_name, *by_name)
    ]

    def pick(model: str | None) -> tuple[InferenceInterface, str]:
        """The interface and the answer's model name of a request's ``model`` (404: unknown)."""
        if not by_name or model in (None, "", model_name):
            return inference, model or model_name
        if model in by_name:
            return by_name[model], model
        names = ", ".join(repr(card.id) for card in served)
        raise HTTPException(404, f"field 'model': the model {model!r} is not served here ({names})")

    async def generate(
        request: InferenceRequest, n: int, model: str | None, http: Request
    ) -> list[InferenceResponse]:
        """``n`` samples of ``request`` by ``model``; the caller's faults are 422 (404 for an
        unknown model, 429 over its in-flight limit), the engine's 503. An outside request is
        cancelled when its client disconnects."""
        chosen, _ = pick(model)

        async def samples() -> list[InferenceResponse]:
            try:
                if n == 1:
                    return [await chosen.generate(request)]
                return await chosen.generate_group(request, n)
            except InvalidInferenceRequest as exc:
                raise HTTPException(422, str(exc)) from None
            except EngineError as exc:
                raise HTTPException(503, f"inference engine unavailable: {exc}") from None

        if request.rollout_key is not None:  # the trainer's rollout: its schedule owns it
            return await samples()
        tokens = n * request.sampling.max_tokens
        if tokens > limits.max_request_tokens:
            raise HTTPException(
                422,
                f"field 'n' x 'max_tokens': {n} x {request.sampling.max_tokens} = {tokens} tokens, "
                f"more than this server generates for one request ({limits.max_request_tokens})",
            )
        with slots.hold(http.client.host if http.client else "unknown"):
            return await unless_disconnected(http, samples())

    @app.get("/health")
    async def health() -> dict[str, str]:
        """Liveness."""
        return {"status": "ok"}

    @app.get("/metrics", response_model=ToolCallMetrics, responses=ERROR_RESPONSES)
    async def metrics() -> ToolCallMetrics:
        """Running counts of chat choices, returned tool calls and tool-call errors."""
        return counter.snapshot()

    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def models() -> ModelList:
        """The models this server generates with (the base, then the named adapters)."""
        return ModelList(data=served)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, http: Request) -> CompletionResponse:
        """Generate ``n`` completions of the prompt with the trainer's current policy."""
        try:
            request = body.to_inference_request()
        except ValueError as exc:
            raise HTTPException(422, f"field 'prompt': {exc}") from None
        outs = await generate(request, body.n, body.model, http)
        choices = []
        for index, out in enumerate(outs):
            logprobs = None
            if body.logprobs is not None:
                pieces = [tokenizer.decode([t]) for t in out.tokens]
                logprobs = CompletionLogprobs(tokens=pieces, token_logprobs=out.logprobs)
            choices.append(
                CompletionChoice(
                    index=index,
                    text=out.text,
                    finish_reason=out.finish_reason,
                    logprobs=logprobs,
                    **choice_extensions(out),
                )
            )
        return CompletionResponse(
            id=f"cmpl-{next(ids)}",
            created=int(time.time()),
            model=pick(body.model)[1],
            choices=choices,
            usage=CompletionUsage.of(outs),
        )

    @app.post(
        "/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERROR_RESPONSES
    )
    async def chat_completions(
        body: ChatCompletionRequest, http: Request
    ) -> ChatCompletionResponse:
        """Generate ``n`` assistant messages for the conversation with the current policy; the
        messages (and ``tools``) are rendered by the trainer tokenizer's chat template and tool
        calls parsed out of the text (``chat_responses``)."""
        if parser is None and body.effective_tool_choice not in ("none", "auto"):
            raise HTTPException(
                422,
                "field 'tool_choice': this server parses no tool calls (--tool-call-parser "
                "none); give 'auto' or 'none'",
            )
        outs = await generate(body.to_inference_request(), body.n, body.model, http)
        name = pick(body.model)[1] if by_name else model_name
        response = chat_completion_response(
            body, outs, tokenizer, parser, response_id=f"chatcmpl-{next(ids)}", model=name
        )
        counter.record(response)
        return response

    @app.post("/v1/rollouts/end", response_model=EndRolloutResponse, responses=ERROR_RESPONSES)
    async def end_rollout(body: EndRolloutRequest) -> EndRolloutResponse:
        """A multi-turn rollout sends no further turn (after a request with ``continued``)."""
        return EndRolloutResponse(awaited=await inference.end_rollout(body.rollout_key))

    install_session_routes(app, inference, tokenizer, model_name, parser)  # agents' base URLs
    return app
