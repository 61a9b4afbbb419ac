"""What agents generate through: ``InferenceInterface`` and its in-process implementation."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from megatron.rl.async_utils import gather_all
from megatron.rl.inference.chat_continuation import environment_tokens
from megatron.rl.inference.protocol import Alternatives, InferenceEngine, InvalidInferenceRequest
from megatron.rl.inference.text_stream import TextStream
from megatron.rl.seeding import derive_seed
from megatron.rl.tokenizer import Tokenizer
from megatron.rl.wire import (
    ChatMessage,
    InferenceRequest,
    InferenceResponse,
    RolloutKey,
    SamplingParams,
    ScoreRequest,
    ScoreResponse,
)


@dataclass(frozen=True)
class TokenDelta:
    """One generated token as a stream sees it, before the request ends."""

    token: int
    logprob: float
    policy_version: int
    alternatives: Alternatives
    """The ``top_logprobs`` most likely tokens at its position (empty when none asked)."""
    text: str
    """The text it adds, possibly empty (held back: half a character, or a possible start of a
    stop string); the final response's ``text`` is the whole of it."""


StreamEvent = TokenDelta | InferenceResponse
"""What ``InferenceInterface.stream`` yields: token deltas, then the whole response."""


class InferenceInterface(ABC):
    """Generates completions for agents. Implementations: in-process engine, HTTP client."""

    base_url: str | None = None
    """HTTP address at which this interface is also served (None: in-process only). Remote
    environments are told this URL so that they generate through the same engine."""

    @abstractmethod
    async def generate(self, request: InferenceRequest) -> InferenceResponse:
        """Generate one completion.

        Raises ``InvalidInferenceRequest`` for a request that cannot be served (the caller's
        fault) and any other exception when inference itself failed.
        """

    async def stream(self, request: InferenceRequest) -> AsyncIterator[StreamEvent]:
        """``generate``'s answer as it is generated: a ``TokenDelta`` per token, then the
        ``InferenceResponse``, whose ``text`` starts with the deltas' text joined. The default
        (an interface that cannot stream) yields the response alone. Closing the iterator early
        cancels the generation."""
        yield await self.generate(request)

    async def score(self, request: ScoreRequest) -> ScoreResponse:
        """The logprob of each token of a text given those before it (nothing generated).
        Raises ``InvalidInferenceRequest`` where the interface cannot score."""
        raise InvalidInferenceRequest(f"{type(self).__name__} does not score texts")

    async def generate_group(self, request: InferenceRequest, n: int) -> list[InferenceResponse]:
        """``n`` samples of one prompt; sample i is ``sample_request(request, i)``.

        The default runs the samples concurrently through ``generate``; the HTTP client sends
        them as one call (OpenAI's ``n``). Either way the samples are identical.
        """
        return await gather_all(*(self.generate(sample_request(request, i)) for i in range(n)))

    async def end_rollout(self, key: RolloutKey) -> bool:
        """Rollout ``key`` sends no further turn: the engine stops waiting for one.

        A multi-turn agent calls it when the environment ends an episode after a request sent
        with ``continued=True``. True if the engine was waiting; the default has no engine.
        """
        return False


async def streamed_response(
    inference: InferenceInterface, request: InferenceRequest, emit: Callable[[TokenDelta], None]
) -> InferenceResponse:
    """``request``'s response, generated through ``inference.stream`` with each token delta
    handed to ``emit`` on the way."""
    stream = inference.stream(request)
    try:
        async for event in stream:
            if isinstance(event, TokenDelta):
                emit(event)
            else:
                return event
    finally:
        await stream.aclose()
    raise RuntimeError(f"{type(inference).__name__}.stream ended without a response")


def sample_request(request: InferenceRequest, i: int) -> InferenceRequest:
    """Sample i of a group request: its own seed, and the i-th rollout key after the given one."""
    key = request.rollout_key
    if key is not None:
        key = key.model_copy(update={"sample_index": key.sample_index + i})
    return request.model_copy(update={"seed": derive_seed(request.seed, i), "rollout_key": key})


def turn_request(
    new: list[ChatMessage] | str,
    last: InferenceResponse | None,
    *,
    turn: int,
    max_turns: int,
    sampling: SamplingParams,
    seed: int,
    key: RolloutKey | None,
    tools: list[dict[str, Any]] | None = None,
) -> InferenceRequest:
    """Turn ``turn`` of a multi-turn rollout as one engine request, the one scheme of every
    multi-turn agent. Turn 0 (``last`` None) is the conversation ``new``; a later turn is the
    previous turn's prompt and generated tokens (``last``) followed by ``new``, the environment's
    answer: chat messages (``suffix_messages``) or text (``prompt_suffix``), so nothing generated
    is tokenized again. Seed ``seed`` at turn 0 and ``derive_seed(seed, turn)`` after; a keyed
    turn that another may follow (``turn + 1 < max_turns``) is sent ``continued``."""
    common: dict[str, Any] = dict(
        sampling=sampling,
        seed=derive_seed(seed, turn) if turn else seed,
        rollout_key=key,
        continued=key is not None and turn + 1 < max_turns,
        tools=tools,
    )
    if last is None:
        if isinstance(new, str):
            raise ValueError("turn 0 of a multi-turn rollout is a conversation of chat messages")
        return InferenceRequest(messages=new, **common)
    context = last.prompt_tokens + last.tokens
    if isinstance(new, str):
        return InferenceRequest(prompt_tokens=context, prompt_suffix=new, **common)
    return InferenceRequest(prompt_tokens=context, suffix_messages=list(new), **common)


class LocalInferenceInterface(InferenceInterface):
    """Tokenizes requests and runs them on the trainer's own ``InferenceEngine``."""

    def __init__(
        self, engine: InferenceEngine, tokenizer: Tokenizer, adapter: str | None = None
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.adapter = adapter
        """The named LoRA adapter set every request generates with (a multi-adapter server's
        model; None: the engine's model as it is)."""

    async def generate(self, request: InferenceRequest) -> InferenceResponse:
        """Run ``request`` on the engine and detokenize the result (watched for its stop
        strings, if it has any)."""
        return await self._generate(request, None)

    async def stream(self, request: InferenceRequest) -> AsyncIterator[StreamEvent]:
        """``generate`` token by token (``InferenceInterface.stream``): the engine hands each
        token to this request's watcher, which queues its delta for this iterator."""
        queue: asyncio.Queue[TokenDelta | None] = asyncio.Queue()
        task = asyncio.ensure_future(self._generate(request, queue.put_nowait))
        task.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (delta := await queue.get()) is not None:
                yield delta
            yield task.result()
        finally:  # the consumer left (or failed): the generation is cancelled
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def score(self, request: ScoreRequest) -> ScoreResponse:
        """Score the text's tokens on the engine (a plain forward of the current policy)."""
        if request.prompt is not None:
            tokens = await asyncio.to_thread(self._encode, request.prompt, "prompt")
        else:
            tokens = self._checked_ids(request.prompt_tokens, "prompt")
        adapter = {} if self.adapter is None else {"adapter": self.adapter}
        out = await self.engine.score(tokens, request.top_logprobs, **adapter)
        return ScoreResponse(
            prompt_tokens=tokens,
            logprobs=out.logprobs,
            top_logprobs=[list(top) for top in out.top_logprobs],
        )

    async def _generate(
        self, request: InferenceRequest, emit: Callable[[TokenDelta], None] | None
    ) -> InferenceResponse:
        """Run ``request``; with ``emit`` or stop strings its tokens are watched as they come
        (``TextStream``: the deltas handed to ``emit``, the stop strings ending it)."""
        key = request.rollout_key
        engine_key = None if key is None else (key.batch_id, key.index_in_batch, key.sample_index)
        try:
            if engine_key is None:  # an outside prompt may be long: tokenize it off the loop
                prompt, prompt_text = await asyncio.to_thread(self._prompt, request)
            else:  # the trainer's rollouts: on the loop, in their arrival order
                prompt, prompt_text = self._prompt(request)
        except InvalidInferenceRequest:
            if engine_key is not None:  # an awaited next turn arrived, unusable: stop waiting
                self.engine.end_rollout(engine_key)
            raise
        options: dict[str, Any] = {} if self.adapter is None else {"adapter": self.adapter}
        text = None
        if emit is not None or request.sampling.stop:
            text = TextStream(self.tokenizer, request.sampling.stop or ())

            def watch(token: int, logprob: float, version: int, top: Alternatives) -> bool:
                delta = text.push(token)
                if emit is not None:
                    emit(TokenDelta(token, logprob, version, top, delta))
                return text.stopped

            options["watch"] = watch
        out = await self.engine.generate(
            prompt, request.sampling, request.seed, engine_key, request.continued, **options
        )
        tops = None
        if out.top_logprobs is not None:
            tops = [list(top) for top in out.top_logprobs]
        return InferenceResponse(
            prompt_tokens=prompt,
            tokens=out.tokens,
            text=self.tokenizer.decode(out.tokens) if text is None else text.final_text(),
            logprobs=out.logprobs,
            policy_versions=out.policy_versions,
            finish_reason=out.finish_reason,
            prompt_text=prompt_text,
            routed_experts=out.routed_experts,
            top_logprobs=tops,
        )

    async def end_rollout(self, key: RolloutKey) -> bool:
        """Release the engine's wait for another turn of ``key``."""
        return self.engine.end_rollout((key.batch_id, key.index_in_batch, key.sample_index))

    def _prompt(self, request: InferenceRequest) -> tuple[list[int], str | None]:
        """The prompt's token ids, and its text when rendered from chat messages:
        ``messages`` through the chat template, ``prompt_tokens`` (checked) + tokenized
        ``prompt_suffix``, or the tokenized ``prompt``."""
        if request.messages is not None:
            text, ids = render_chat(self.tokenizer, request.messages, request.tools)
            return ids, text
        if request.prompt_tokens is None:
            return self._encode(request.prompt, "prompt"), None
        prompt = self._checked_ids(request.prompt_tokens, "prompt_tokens")
        if request.prompt_suffix is not None:
            prompt += self._encode(request.prompt_suffix, "prompt_suffix", continuation=True)
        if request.suffix_messages is not None:
            prompt += environment_tokens(
                self.tokenizer, request.suffix_messages, prompt, request.tools
            )
        return prompt, None

    def _checked_ids(self, ids: list[int], field: str) -> list[int]:
        """``ids`` as a list, or ``InvalidInferenceRequest`` naming ``field`` for an id outside
        the vocabulary."""
        bad = [t for t in ids if not 0 <= t < self.tokenizer.vocab_size]
        if bad:
            raise InvalidInferenceRequest(f"{field} has ids outside the vocabulary: {bad[:5]}")
        return list(ids)

    def _encode(self, text: str, field: str, continuation: bool = False) -> list[int]:
        encode = self.tokenizer.encode_continuation if continuation else self.tokenizer.encode
        try:
            return encode(text)
        except ValueError as exc:
            raise InvalidInferenceRequest(f"{field}: {exc}") from None


def render_chat(
    tokenizer: Tokenizer, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None
) -> tuple[str, list[int]]:
    """The prompt text and token ids of ``messages`` (and ``tools``, OpenAI function schemas),
    rendered by the tokenizer's chat template with the assistant's generation prompt.

    Raises ``InvalidInferenceRequest`` when the tokenizer has no chat template (``CharTokenizer``,
    or a Hugging Face tokenizer without one) or the template refuses the conversation.
    """
    template = getattr(tokenizer, "chat_template", None)
    renders = hasattr(tokenizer, "apply_chat_template") and hasattr(tokenizer, "encode_chat")
    if not template or not renders:
        raise InvalidInferenceRequest(
            f"messages: the tokenizer ({type(tokenizer).__name__}) has no chat template, so a "
            "prompt given as chat messages cannot be rendered; give the environment's prompt as "
            "text, or use a tokenizer with a chat template"
        )
    dicts = [m.template_dict() for m in messages]
    try:
        if tools is None:  # tokenizers of tests and tools may not take ``tools``
            text = tokenizer.apply_chat_template(dicts, add_generation_prompt=True)
            ids = tokenizer.encode_chat(dicts)
        else:
            text = tokenizer.apply_chat_template(dicts, add_generation_prompt=True, tools=tools)
            ids = tokenizer.encode_chat(dicts, tools=tools)
    except Exception as exc:  # jinja2 errors, the template's raise_exception, ...
        raise InvalidInferenceRequest(
            f"messages: the tokenizer's chat template cannot render them: {exc}"
        ) from None
    return text, ids
