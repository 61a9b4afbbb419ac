"""``InferenceInterface`` over HTTP: how an environment on the env server reaches the trainer."""

from __future__ import annotations

from typing import Any

from megatron.rl.auth import bearer_headers
from megatron.rl.http_client import ClientPool, RemoteCallError, RetryPolicy, call_json
from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.inference.protocol import InvalidInferenceRequest
from megatron.rl.wire import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    EndRolloutRequest,
    EndRolloutResponse,
    InferenceRequest,
    InferenceResponse,
    RolloutKey,
    ScoreRequest,
    ScoreResponse,
    WireModel,
)

REFUSED = frozenset({401, 403, 429})
"""4xx answers about the caller (its key, its rate), not the request: the server is unavailable."""


class InferenceUnavailable(RuntimeError):
    """The inference server could not be reached or failed; the message names its URL."""


def fits_chat_endpoint(request: InferenceRequest) -> bool:
    """Whether OpenAI's chat API carries all of ``request`` (a request of ``messages``): not a
    chat episode's first turn (``continued``, ``tools``), which goes to ``/v1/completions``."""
    return not request.continued and request.tools is None


class RemoteInferenceInterface(InferenceInterface):
    """Generates through ``POST {base_url}/v1/completions`` (prompts of text or token ids, and
    chat requests that need its extensions) or ``POST {base_url}/v1/chat/completions`` (chat
    messages) with shared pooled clients."""

    def __init__(
        self,
        base_url: str,
        client: ClientPool,
        retry: RetryPolicy = RetryPolicy(),
        keep_rollout_keys: bool = True,
        api_key: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.client = client
        self.retry = retry
        self.keep_rollout_keys = keep_rollout_keys
        """False for evaluation traffic, which must not enter the training schedule."""
        self._headers = bearer_headers(api_key)

    async def generate(self, request: InferenceRequest) -> InferenceResponse:
        """One completion (see ``generate_group``)."""
        (response,) = await self._complete(request, 1)
        return response

    async def generate_group(self, request: InferenceRequest, n: int) -> list[InferenceResponse]:
        """``n`` samples in one HTTP call. 4xx answers raise ``InvalidInferenceRequest``, other
        failures (``REFUSED`` answers among them) ``InferenceUnavailable``."""
        return await self._complete(request, n)

    async def score(self, request: ScoreRequest) -> ScoreResponse:
        """``POST {base_url}/v1/completions`` with ``echo``, ``logprobs`` 0 and ``max_tokens`` 0:
        the prompt's token logprobs from any server that scores that way (ours included).
        Alternatives are refused: OpenAI's format names them by text, not by token id."""
        if request.top_logprobs:
            raise InvalidInferenceRequest(
                "top_logprobs: a remote server names alternatives by their text, not their ids"
            )
        prompt = request.prompt if request.prompt is not None else request.prompt_tokens
        body = CompletionRequest(prompt=prompt, max_tokens=0, echo=True, logprobs=0)
        payload = await self._call("/v1/completions", body)
        try:
            (choice,) = CompletionResponse.model_validate(payload).choices
            values = choice.logprobs.token_logprobs[1:] if choice.logprobs is not None else None
            return ScoreResponse(
                prompt_tokens=choice.prompt_token_ids,
                logprobs=values,
                top_logprobs=[[] for _ in values or ()],
            )
        except ValueError as exc:
            raise InferenceUnavailable(
                f"inference server {self.base_url} sent an invalid scored prompt: {exc}"
            ) from None

    async def end_rollout(self, key: RolloutKey) -> bool:
        """``POST {base_url}/v1/rollouts/end``: the engine stops waiting for another turn."""
        if not self.keep_rollout_keys:  # its requests went out unkeyed: nothing is awaited
            return False
        payload = await self._call("/v1/rollouts/end", EndRolloutRequest(rollout_key=key))
        try:
            return EndRolloutResponse.model_validate(payload).awaited
        except ValueError as exc:
            raise InferenceUnavailable(
                f"inference server {self.base_url} sent an invalid answer: {exc}"
            ) from None

    async def _complete(self, request: InferenceRequest, n: int) -> list[InferenceResponse]:
        if not self.keep_rollout_keys and request.rollout_key is not None:
            request = request.model_copy(update={"rollout_key": None, "continued": False})
        body: CompletionRequest | ChatCompletionRequest
        if request.messages is not None and fits_chat_endpoint(request):
            path = "/v1/chat/completions"  # rendered by the trainer's tokenizer
            body = ChatCompletionRequest.from_inference_request(request, n)
            answer: type[CompletionResponse | ChatCompletionResponse] = ChatCompletionResponse
        else:
            path = "/v1/completions"
            body = CompletionRequest.from_inference_request(request, n)
            answer = CompletionResponse
        payload = await self._call(path, body)
        try:
            responses = answer.model_validate(payload).to_inference_responses()
        except ValueError as exc:
            raise InferenceUnavailable(
                f"inference server {self.base_url} sent an invalid completion: {exc}"
            ) from None
        if len(responses) != n:
            raise InferenceUnavailable(
                f"inference server {self.base_url} sent {len(responses)} choices for n={n}"
            )
        return responses

    async def _call(self, path: str, body: WireModel) -> Any:
        """POST ``body`` (with the key); 4xx answers raise ``InvalidInferenceRequest``, other
        failures (``REFUSED`` answers among them) ``InferenceUnavailable``."""
        url = f"{self.base_url}{path}"
        try:
            return await call_json(self.client, "POST", url, body, self.retry, self._headers)
        except RemoteCallError as exc:
            if exc.status is not None and 400 <= exc.status < 500 and exc.status not in REFUSED:
                raise InvalidInferenceRequest(str(exc)) from None
            raise InferenceUnavailable(f"inference server {self.base_url}: {exc}") from None
