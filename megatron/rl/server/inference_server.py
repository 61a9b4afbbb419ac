"""The trainer's inference server: remote environments generate through the trainer's engine.

``create_inference_app(inference, tokenizer)`` exposes an ``InferenceInterface`` (in the trainer:
the ``LocalInferenceInterface`` over the engine that serves local agents too) as a subset of the
OpenAI API: ``POST /v1/completions`` (``wire.CompletionRequest``: one prompt or a batch; ``echo``
with the prompt's logprobs from a plain forward, ``InferenceInterface.score``, and ``max_tokens``
0 to score only; ``completion_responses``) and ``POST /v1/chat/completions``
(``wire.ChatCompletionRequest``; the messages are rendered by the tokenizer's chat template, and
a tokenizer without one answers 422 naming it; ``tools`` are rendered by the template and the
model's tool calls parsed out of its text by the ``tool_call_parser``, see ``chat_responses``),
both with ``stop`` strings, up to 20 alternatives per token and ``stream`` (server-sent chunks,
``streaming.py``), plus ``GET /v1/models`` (the models served, OpenAI's list format; another
``model`` is a 404 naming it), ``GET /metrics`` (running tool-call counts,
``wire.ToolCallMetrics``) and one OpenAI base URL per agent session, ``/sessions/{token}/v1``
(``sessions.py``). Requests go into the same engine queue as local ones, so they belong to the
same batches, follow the same forced-lag schedule and return the same per-token logprobs and
policy versions.

Outside requests (no rollout key) are bounded (``limits.py``): the body size (413), prompts x
``n`` x ``max_tokens`` (422); they wait their turn in a ``FairQueue`` (``fair_queue.py``: the
engine slots they may take, the requests running per client address, round robin across
addresses; a stream holds its turn until it ends), which answers 429 with ``Retry-After`` only
past its bound; a client that disconnects leaves the queue, or cancels its generation, whose
slot the engine frees at its next step. Keyed requests skip the queue.

Note that the trainer's event loop, and with it this server, only runs while the trainer waits
for a batch; a request sent during a training step is answered when the next window opens.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from fastapi import FastAPI, HTTPException, Request

from megatron.rl.async_utils import gather_all
from megatron.rl.auth import require_api_key
from megatron.rl.inference.interface import InferenceInterface, sample_request
from megatron.rl.inference.protocol import EngineError, InvalidInferenceRequest
from megatron.rl.inference.sessions import SESSIONS_PREFIX
from megatron.rl.server.chat_responses import ToolCallCounter, chat_completion_response
from megatron.rl.server.completion_responses import completion_choices
from megatron.rl.server.http import ERROR_RESPONSES, install_error_handlers
from megatron.rl.server.limits import (
    BodyLimit,
    ServerLimits,
    admission,
    client_of,
    unless_disconnected,
)
from megatron.rl.server.sessions import install_session_routes
from megatron.rl.server.streaming import (
    ChatChunks,
    CompletionChunks,
    EventStream,
    merged_events,
    prepend,
    sse_events,
)
from megatron.rl.tokenizer import Tokenizer
from megatron.rl.tools.parsers import AUTO, resolve_tool_call_parser
from megatron.rl.wire import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionUsage,
    EndRolloutRequest,
    EndRolloutResponse,
    InferenceRequest,
    InferenceResponse,
    ModelCard,
    ModelList,
    ScoreRequest,
    ToolCallMetrics,
)

T = TypeVar("T")


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
    named LoRA adapter set. A request's ``model`` picks one: ``model_name`` (or no model) is
    ``inference``'s, any other name is answered 404 naming the models served. ``limits``: what
    one outside request and one client may take (``limits.py``)."""
    parser = resolve_tool_call_parser(tool_call_parser, getattr(tokenizer, "chat_template", None))
    counter = ToolCallCounter()
    app = FastAPI(title="megatron-rl inference server", version="1")
    install_error_handlers(app)
    require_api_key(app, api_key, exempt_prefix=SESSIONS_PREFIX + "/")  # sessions: their own
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    queue = admission(limits)
    app.state.admission = queue  # the queue of outside requests (its length, for tests and logs)
    ids = itertools.count()
    created = int(time.time())
    by_name = dict(adapters or {})
    served = [
        ModelCard(id=name, created=created, owned_by="megatron-rl")
        for name in (model_name, *by_name)
    ]

    def pick(model: str | None) -> tuple[InferenceInterface, str]:
        """The interface and the answer's model name of a request's ``model`` (404: unknown)."""
        if model in (None, "", model_name):
            return inference, model_name
        if model in by_name:
            return by_name[model], model
        names = ", ".join(repr(card.id) for card in served)
        raise HTTPException(404, f"field 'model': the model {model!r} is not served here ({names})")

    async def answer(work: Awaitable[T]) -> T:
        """``work``'s result; the caller's faults are 422, the engine's 503."""
        try:
            return await work
        except InvalidInferenceRequest as exc:
            raise HTTPException(422, str(exc)) from None
        except EngineError as exc:
            raise HTTPException(503, f"inference engine unavailable: {exc}") from None

    def check_size(requests: list[InferenceRequest], n: int) -> None:
        """422 for an outside request over the server's token limit (``limits``)."""
        if any(r.rollout_key is not None for r in requests):
            return  # the trainer's rollout: its schedule owns it
        budget = requests[0].sampling.max_tokens
        tokens = len(requests) * n * budget
        if tokens > limits.max_request_tokens:
            raise HTTPException(
                422,
                f"field 'n' x 'max_tokens': {len(requests)} prompt(s) x {n} x {budget} = "
                f"{tokens} tokens, more than this server generates for one request "
                f"({limits.max_request_tokens})",
            )

    async def outside(
        http: Request, keyed: bool, weight: int, work: Callable[[], Awaitable[T]]
    ) -> T:
        """Run ``work()`` for a request: an outside one (of ``weight`` engine requests) first
        waits its turn in the queue (429 past its bound), and its wait or its generation is
        cancelled when its client disconnects; a keyed one just runs."""
        if keyed:
            return await work()

        async def in_turn() -> T:
            release = await queue.admit(client_of(http), weight)
            try:
                return await work()
            finally:
                release()

        return await unless_disconnected(http, in_turn())

    async def samples(chosen: InferenceInterface, request: InferenceRequest, n: int):
        """``n`` samples of ``request``."""
        if n == 1:
            return [await answer(chosen.generate(request))]
        return await answer(chosen.generate_group(request, n))

    async def streamed(
        http: Request,
        chosen: InferenceInterface,
        requests: list[InferenceRequest],
        n: int,
        chunks: ChatChunks | CompletionChunks,
        include_usage: bool,
    ) -> EventStream:
        """The streamed answer of ``n`` samples of each request (an outside one: a keyed one is
        answered whole), once its turn came in the queue (held until the stream ends): the
        engine's first event (or its refusal, as a status) is awaited before the response
        starts."""
        seeded = [r if n == 1 else sample_request(r, i) for r in requests for i in range(n)]
        release = await unless_disconnected(http, queue.admit(client_of(http), len(seeded)))
        try:
            streams = [chosen.stream(sample) for sample in seeded]  # seeded as ``samples`` does
            events = merged_events(streams)
            try:
                first = await unless_disconnected(http, answer(anext(events)))
            except BaseException:
                await events.aclose()
                raise
        except BaseException:
            release()
            raise
        return EventStream(sse_events(chunks, prepend(first, events), include_usage), release)

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
    async def completions(body: CompletionRequest, http: Request) -> Any:
        """Generate ``n`` completions of each prompt with the current policy (``echo``: after
        the prompt and its logprobs; ``max_tokens`` 0: the scored prompt alone)."""
        chosen, name = pick(body.model)
        try:
            requests = [body.to_inference_request(p) for p in body.prompts() or [None]]
        except ValueError as exc:
            raise HTTPException(422, f"field 'prompt': {exc}") from None
        check_size(requests, body.n)
        response_id = f"cmpl-{next(ids)}"
        if body.stream:
            chunks = CompletionChunks(body, tokenizer, response_id, name)
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return await streamed(http, chosen, requests, body.n, chunks, usage)
        keyed = requests[0].rollout_key is not None

        def work() -> Awaitable[list[tuple[list[int], list[CompletionChoice]]]]:
            return gather_all(
                *(completion_of(chosen, body, r, p * body.n) for p, r in enumerate(requests))
            )

        answers = await outside(http, keyed, len(requests) * body.n, work)
        choices = [choice for _, prompt_choices in answers for choice in prompt_choices]
        prompt_tokens = sum(len(prompt) for prompt, _ in answers)
        generated = sum(len(c.token_ids) for c in choices)
        return CompletionResponse(
            id=response_id,
            created=int(time.time()),
            model=name,
            choices=choices,
            usage=CompletionUsage(
                prompt_tokens=prompt_tokens,
                completion_tokens=generated,
                total_tokens=prompt_tokens + generated,
            ),
        )

    async def completion_of(
        chosen: InferenceInterface, body: CompletionRequest, request: InferenceRequest, first: int
    ) -> tuple[list[int], list[CompletionChoice]]:
        """(prompt ids, choices numbered from ``first``) of one prompt of a completion request."""
        scoring = body.echo and body.logprobs is not None
        outs: list[InferenceResponse] = []
        if body.max_tokens > 0:
            outs = await samples(chosen, request, body.n)
        prompt_ids = outs[0].prompt_tokens if outs else request.prompt_tokens
        scored = None
        if scoring:  # the generation's tokens of the prompt, else the text tokenized there
            score = ScoreRequest(
                prompt=None if prompt_ids else request.prompt,
                prompt_tokens=prompt_ids,
                top_logprobs=body.logprobs or 0,
            )
            scored = await answer(chosen.score(score))
            prompt_ids = scored.prompt_tokens
        elif prompt_ids is None:  # echo without logprobs, nothing generated: the ids only
            prompt_ids = await asyncio.to_thread(tokenizer.encode, request.prompt)
        text = request.prompt if request.prompt is not None else tokenizer.decode(prompt_ids)
        choices = completion_choices(body, first, prompt_ids, text, outs, scored, tokenizer)
        return prompt_ids, choices

    @app.post(
        "/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERROR_RESPONSES
    )
    async def chat_completions(body: ChatCompletionRequest, http: Request) -> Any:
        """Generate ``n`` assistant messages for the conversation with the current policy; the
        messages (and ``tools``) are rendered by the trainer tokenizer's chat template and tool
        calls parsed out of the text (``chat_responses``)."""
        if parser is None and body.effective_tool_choice not in ("none", "auto"):
            raise HTTPException(
                422,
                "field 'tool_choice': this server parses no tool calls (--tool-call-parser "
                "none); give 'auto' or 'none'",
            )
        chosen, name = pick(body.model)
        request = body.to_inference_request()
        check_size([request], body.n)
        response_id = f"chatcmpl-{next(ids)}"
        if body.stream:
            chunks = ChatChunks(body, tokenizer, parser, response_id, name, counter)
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return await streamed(http, chosen, [request], body.n, chunks, usage)
        keyed = request.rollout_key is not None
        outs = await outside(http, keyed, body.n, lambda: samples(chosen, request, body.n))
        response = chat_completion_response(
            body, outs, tokenizer, parser, response_id=response_id, model=name
        )
        counter.record(response)
        return response

    @app.post("/v1/rollouts/end", response_model=EndRolloutResponse, responses=ERROR_RESPONSES)
    async def end_rollout(body: EndRolloutRequest) -> EndRolloutResponse:
        """A multi-turn rollout sends no further turn (after a request with ``continued``)."""
        return EndRolloutResponse(awaited=await inference.end_rollout(body.rollout_key))

    install_session_routes(app, inference, tokenizer, model_name, parser)  # agents' base URLs
    return app
