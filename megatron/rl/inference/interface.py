"""What agents generate through: ``InferenceInterface`` and its in-process implementation."""

from __future__ import annotations

from abc import ABC, abstractmethod

from megatron.rl.async_utils import gather_all
from megatron.rl.inference.protocol import InferenceEngine, InvalidInferenceRequest
from megatron.rl.seeding import derive_seed
from megatron.rl.tokenizer import Tokenizer
from megatron.rl.wire import ChatMessage, InferenceRequest, InferenceResponse


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

    async def generate_group(self, request: InferenceRequest, n: int) -> list[InferenceResponse]:
        """``n`` samples of one prompt; sample i is ``sample_request(request, i)``.

        The default runs the samples concurrently through ``generate``; the HTTP client sends
        them as one call (OpenAI's ``n``). Either way the samples are identical.
        """
        return await gather_all(*(self.generate(sample_request(request, i)) for i in range(n)))


def sample_request(request: InferenceRequest, i: int) -> InferenceRequest:
    """Sample i of a group request: its own seed, and the i-th rollout key after the given one."""
    key = request.rollout_key
    if key is not None:
        key = key.model_copy(update={"sample_index": key.sample_index + i})
    return request.model_copy(update={"seed": derive_seed(request.seed, i), "rollout_key": key})


class LocalInferenceInterface(InferenceInterface):
    """Tokenizes requests and runs them on the trainer's own ``InferenceEngine``."""

    def __init__(self, engine: InferenceEngine, tokenizer: Tokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer

    async def generate(self, request: InferenceRequest) -> InferenceResponse:
        """Run ``request`` on the engine and detokenize the result."""
        prompt_text = None
        if request.messages is not None:
            prompt_text, prompt = render_chat(self.tokenizer, request.messages)
        elif request.prompt_tokens is not None:
            prompt = list(request.prompt_tokens)
            bad = [t for t in prompt if not 0 <= t < self.tokenizer.vocab_size]
            if bad:
                raise InvalidInferenceRequest(
                    f"prompt_tokens has ids outside the vocabulary: {bad[:5]}"
                )
        else:
            try:
                prompt = self.tokenizer.encode(request.prompt)
            except ValueError as exc:
                raise InvalidInferenceRequest(f"prompt: {exc}") from None
        key = request.rollout_key
        out = await self.engine.generate(
            prompt,
            request.sampling,
            request.seed,
            None if key is None else (key.batch_id, key.index_in_batch, key.sample_index),
        )
        return InferenceResponse(
            prompt_tokens=prompt,
            tokens=out.tokens,
            text=self.tokenizer.decode(out.tokens),
            logprobs=out.logprobs,
            policy_versions=out.policy_versions,
            finish_reason=out.finish_reason,
            prompt_text=prompt_text,
        )


def render_chat(tokenizer: Tokenizer, messages: list[ChatMessage]) -> tuple[str, list[int]]:
    """The prompt text and token ids of ``messages``, rendered by the tokenizer's chat template
    with the assistant's generation prompt.

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
    dicts = [m.model_dump() for m in messages]
    try:
        text = tokenizer.apply_chat_template(dicts, add_generation_prompt=True)
        ids = tokenizer.encode_chat(dicts)
    except Exception as exc:  # jinja2 errors, the template's raise_exception, ...
        raise InvalidInferenceRequest(
            f"messages: the tokenizer's chat template cannot render them: {exc}"
        ) from None
    return text, ids
