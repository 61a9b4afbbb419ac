"""Streamed answers (``"stream": true``): the engine's token deltas -> OpenAI's server-sent chunks.

``merged_events`` runs the streams of every choice (``InferenceInterface.stream``: one per sample
of each prompt) and yields their events as they come, tagged with the choice's index; it owns
their tasks, so closing it cancels every generation still running. ``ChatChunks`` and
``CompletionChunks`` turn one choice's events into chunks (``wire.streaming``): a chat choice
starts with a role chunk, each token adds its text (nothing while a stop string may be starting
or a character is incomplete) with its logprob entry and, as extensions, its id and policy
version; the choice's last chunk sends the text left, the ``finish_reason`` and the prompt's
token ids. With tools (a parser, ``tool_choice`` not ``none``) a chat choice's text is held to
its end, parsed as a non-streamed answer is (``chat_responses.tool_call_message``), and sent as
its content and one tool-call delta per call (id, type and name, then the arguments). So the
chunks of a choice join to exactly the non-streamed choice. ``EventStream`` sends the events
and, when the client disconnects, stops: closing the events cancels the generations (the engine
frees their slots at its next step).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

from starlette.responses import StreamingResponse

from megatron.rl.inference.interface import StreamEvent, TokenDelta
from megatron.rl.server.chat_responses import ToolCallCounter, token_logprobs, tool_call_message
from megatron.rl.server.completion_responses import completion_logprobs
from megatron.rl.tokenizer import Tokenizer
from megatron.rl.tools.parsers import ToolCallParser
from megatron.rl.wire import (
    ChatCompletionRequest,
    CompletionRequest,
    CompletionUsage,
    InferenceResponse,
    WireModel,
)
from megatron.rl.wire.streaming import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChunk,
    CompletionChunkChoice,
    ToolCallDelta,
    ToolCallFunctionDelta,
)

DONE = "data: [DONE]\n\n"
T = TypeVar("T")


def sse(chunk: WireModel | dict[str, Any]) -> str:
    """One server-sent event carrying ``chunk`` as JSON."""
    text = chunk.model_dump_json() if isinstance(chunk, WireModel) else json.dumps(chunk)
    return f"data: {text}\n\n"


async def merged_events(
    streams: list[AsyncIterator[StreamEvent]],
) -> AsyncIterator[tuple[int, StreamEvent]]:
    """(stream index, event) of every stream as they come; the first stream failure is raised.
    Owns one task per stream: closing this iterator (or its failure) cancels and awaits them."""
    queue: asyncio.Queue[tuple[int, StreamEvent] | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[StreamEvent]) -> None:
        try:
            async for event in stream:
                queue.put_nowait((index, event))
        finally:
            await stream.aclose()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    for task in tasks:
        task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is not None:
                yield item
                continue
            running -= 1
            for task in tasks:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def prepend(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """``first``, then the items of ``rest``; closing this iterator closes ``rest``."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()


class _Choice:
    """What has been sent of one choice: its tokens and its text."""

    def __init__(self) -> None:
        self.tokens = 0
        self.text = ""


class ChatChunks:
    """Chunks of a streamed chat completion (one response id, every choice)."""

    def __init__(
        self,
        body: ChatCompletionRequest,
        tokenizer: Tokenizer,
        parser: ToolCallParser | None,
        response_id: str,
        model: str,
        counter: ToolCallCounter | None = None,
    ) -> None:
        self.body, self.tokenizer, self.parser = body, tokenizer, parser
        self.id, self.model, self.created = response_id, model, int(time.time())
        self.counter = counter
        self.holds_text = parser is not None and body.effective_tool_choice != "none"
        """Tool calls are parsed from the whole text: content is sent at the choice's end."""
        self._choices = [_Choice() for _ in range(body.n)]
        self._call_ids = itertools.count()

    def start(self) -> Iterator[ChatCompletionChunk]:
        """Each choice's role chunk."""
        for index in range(self.body.n):
            yield self._chunk(index, ChatDelta(role="assistant", content=""), [], [])

    def token(self, index: int, delta: TokenDelta) -> ChatCompletionChunk:
        """The chunk of one generated token."""
        sent = self._choices[index]
        sent.tokens += 1
        text = None
        if not self.holds_text and delta.text:
            text, sent.text = delta.text, sent.text + delta.text
        logprobs = None
        if self.body.logprobs:
            logprobs = token_logprobs(
                self.tokenizer, [delta.token], [delta.logprob], [delta.alternatives]
            )
        return self._chunk(
            index, ChatDelta(content=text), [delta.token], [delta.policy_version], logprobs
        )

    def finish(self, index: int, out: InferenceResponse) -> Iterator[ChatCompletionChunk]:
        """The choice's last chunks: tokens not yet sent, the text left (or, with tools, the
        content and tool calls), then its ``finish_reason``."""
        sent = self._choices[index]
        rest_tokens = slice(sent.tokens, None)
        if out.tokens[rest_tokens]:
            logprobs = None
            if self.body.logprobs:
                logprobs = token_logprobs(
                    self.tokenizer,
                    out.tokens[rest_tokens],
                    out.logprobs[rest_tokens],
                    (out.top_logprobs or [])[rest_tokens] or None,
                )
            yield self._chunk(
                index,
                ChatDelta(),
                out.tokens[rest_tokens],
                out.policy_versions[rest_tokens],
                logprobs,
            )
        errors = 0
        reason = out.finish_reason
        if self.holds_text:
            message, reason, errors = tool_call_message(self.body, out, self.parser, self._call_ids)
            if message.content:
                yield self._chunk(index, ChatDelta(content=message.content), [], [])
            for number, call in enumerate(message.tool_calls or ()):
                head = ToolCallDelta(
                    index=number,
                    id=call.id,
                    type="function",
                    function=ToolCallFunctionDelta(name=call.function.name, arguments=""),
                )
                args = ToolCallDelta(
                    index=number,
                    function=ToolCallFunctionDelta(arguments=call.function.arguments),
                )
                for piece in (head, args):
                    yield self._chunk(index, ChatDelta(tool_calls=[piece]), [], [])
            if self.counter is not None:
                self.counter.count(len(message.tool_calls or ()), errors)
        else:
            if out.text[len(sent.text) :]:
                yield self._chunk(index, ChatDelta(content=out.text[len(sent.text) :]), [], [])
            if self.counter is not None:
                self.counter.count(0, 0)
        last = self._chunk(index, ChatDelta(), [], [])
        last.choices[0].finish_reason = reason
        last.choices[0].prompt_token_ids = out.prompt_tokens
        last.choices[0].prompt_text = out.prompt_text or ""
        last.choices[0].tool_call_errors = errors
        last.choices[0].routed_experts = out.routed_experts
        yield last

    def usage(self, outs: list[InferenceResponse]) -> ChatCompletionChunk:
        """The usage chunk (``stream_options.include_usage``)."""
        return ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[],
            usage=CompletionUsage.of(outs),
        )

    def _chunk(
        self,
        index: int,
        delta: ChatDelta,
        tokens: list[int],
        versions: list[int],
        logprobs: Any = None,
    ) -> ChatCompletionChunk:
        choice = ChatChunkChoice(
            index=index,
            delta=delta,
            logprobs=logprobs,
            token_ids=tokens,
            policy_versions=versions,
        )
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[choice]
        )


class CompletionChunks:
    """Chunks of a streamed completion (one response id, every choice of every prompt)."""

    def __init__(
        self, body: CompletionRequest, tokenizer: Tokenizer, response_id: str, model: str
    ) -> None:
        self.body, self.tokenizer = body, tokenizer
        self.id, self.model, self.created = response_id, model, int(time.time())
        self._choices = [_Choice() for _ in range(body.n * max(len(body.prompts()), 1))]

    def token(self, index: int, delta: TokenDelta) -> CompletionChunk:
        """The chunk of one generated token."""
        sent = self._choices[index]
        sent.tokens += 1
        logprobs = None
        if self.body.logprobs is not None:
            tops = [delta.alternatives]
            logprobs = completion_logprobs(
                self.tokenizer, [delta.token], [delta.logprob], tops, len(sent.text)
            )
        sent.text += delta.text
        return self._chunk(index, delta.text, [delta.token], [delta.policy_version], logprobs)

    def finish(self, index: int, out: InferenceResponse) -> Iterator[CompletionChunk]:
        """The choice's last chunk: the tokens and text not yet sent, its ``finish_reason``."""
        sent = self._choices[index]
        rest = slice(sent.tokens, None)
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = completion_logprobs(
                self.tokenizer,
                out.tokens[rest],
                out.logprobs[rest],
                (out.top_logprobs or [])[rest] or None,
                len(sent.text),
            )
        last = self._chunk(
            index, out.text[len(sent.text) :], out.tokens[rest], out.policy_versions[rest], logprobs
        )
        last.choices[0].finish_reason = out.finish_reason
        last.choices[0].prompt_token_ids = out.prompt_tokens
        last.choices[0].routed_experts = out.routed_experts
        yield last

    def usage(self, outs: list[InferenceResponse]) -> CompletionChunk:
        """The usage chunk (``stream_options.include_usage``): each prompt counted once."""
        prompts = {}
        for index, out in enumerate(outs):
            prompts[index // self.body.n] = len(out.prompt_tokens)
        completion = sum(len(out.tokens) for out in outs)
        usage = CompletionUsage(
            prompt_tokens=sum(prompts.values()),
            completion_tokens=completion,
            total_tokens=sum(prompts.values()) + completion,
        )
        return CompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )

    def _chunk(
        self,
        index: int,
        text: str,
        tokens: list[int],
        versions: list[int],
        logprobs: Any = None,
    ) -> CompletionChunk:
        choice = CompletionChunkChoice(
            index=index, text=text, logprobs=logprobs, token_ids=tokens, policy_versions=versions
        )
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])


async def sse_events(
    chunks: ChatChunks | CompletionChunks,
    events: AsyncIterator[tuple[int, StreamEvent]],
    include_usage: bool,
) -> AsyncIterator[str]:
    """The server-sent events of a whole streamed answer: each choice's chunks as its events
    come, the usage chunk if asked, ``[DONE]``. A failure after the start is sent as an error
    event before ``[DONE]``; closing this iterator closes ``events``."""
    finals: dict[int, InferenceResponse] = {}
    try:
        if isinstance(chunks, ChatChunks):
            for chunk in chunks.start():
                yield sse(chunk)
        async for index, event in events:
            if isinstance(event, TokenDelta):
                yield sse(chunks.token(index, event))
                continue
            finals[index] = event
            for chunk in chunks.finish(index, event):
                yield sse(chunk)
        if include_usage:
            yield sse(chunks.usage([finals[i] for i in sorted(finals)]))
    except Exception as exc:  # the stream has begun: the error travels as an event
        yield sse({"error": {"message": f"generation failed: {exc}", "type": type(exc).__name__}})
    finally:
        await events.aclose()
    yield DONE


class EventStream(StreamingResponse):
    """A ``text/event-stream`` response that stops when its client disconnects (whatever the
    ASGI server's version) and then closes its events and calls ``release`` (always, once)."""

    def __init__(
        self, events: AsyncIterator[str], release: Callable[[], None] = lambda: None
    ) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = events
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        sending = asyncio.ensure_future(self.stream_response(send))
        leaving = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({sending, leaving}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (sending, leaving):
                task.cancel()
            await asyncio.gather(sending, leaving, return_exceptions=True)
            await self._events.aclose()
            self._release()
        if sending.done() and not sending.cancelled() and sending.exception() is not None:
            if not isinstance(sending.exception(), OSError):  # OSError: the client went away
                raise sending.exception()
