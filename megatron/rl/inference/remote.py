"""``InferenceInterface`` over HTTP: how an environment on the env server reaches the trainer."""

from __future__ import annotations

from megatron.rl.auth import bearer_headers
from megatron.rl.http_client import ClientPool, RemoteCallError, RetryPolicy, call_json
from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.inference.protocol import InvalidInferenceRequest
from megatron.rl.wire import (
    CompletionRequest,
    CompletionResponse,
    InferenceRequest,
    InferenceResponse,
)

REFUSED = frozenset({401, 403, 429})
"""4xx answers about the caller (its key, its rate), not the request: the server is unavailable."""


class InferenceUnavailable(RuntimeError):
    """The inference server could not be reached or failed; the message names its URL."""


class RemoteInferenceInterface(InferenceInterface):
    """Generates through ``POST {base_url}/v1/completions`` with shared pooled clients."""

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

    async def _complete(self, request: InferenceRequest, n: int) -> list[InferenceResponse]:
        if not self.keep_rollout_keys and request.rollout_key is not None:
            request = request.model_copy(update={"rollout_key": None})
        url = f"{self.base_url}/v1/completions"
        body = CompletionRequest.from_inference_request(request, n)
        try:
            payload = await call_json(self.client, "POST", url, body, self.retry, self._headers)
        except RemoteCallError as exc:
            if exc.status is not None and 400 <= exc.status < 500 and exc.status not in REFUSED:
                raise InvalidInferenceRequest(str(exc)) from None
            raise InferenceUnavailable(f"inference server {self.base_url}: {exc}") from None
        try:
            responses = CompletionResponse.model_validate(payload).to_inference_responses()
        except ValueError as exc:
            raise InferenceUnavailable(
                f"inference server {self.base_url} sent an invalid completion: {exc}"
            ) from None
        if len(responses) != n:
            raise InferenceUnavailable(
                f"inference server {self.base_url} sent {len(responses)} choices for n={n}"
            )
        return responses
