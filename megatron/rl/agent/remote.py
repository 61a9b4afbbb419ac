"""``agent_type: remote``: an environment hosted by an env server, driven over HTTP.

    - agent_type: remote
      agent_args: {url: "http://127.0.0.1:8000", env_id: copy}

Each group is one ``POST {url}/v1/grouped_rollouts`` carrying the request and the trainer's
inference URL; the env server's environment generates through that URL, so its tokens come from
the trainer's engine with the same forced-lag accounting as local environments. One pooled
``httpx.AsyncClient`` serves all groups; failed calls are retried with backoff and then fail the
run with a ``RemoteEnvironmentError`` naming the server.
"""

from __future__ import annotations

import os

import httpx
from pydantic import Field

from megatron.rl.agent.api import Agent, AgentArgs
from megatron.rl.auth import API_KEY_ENV, bearer_headers
from megatron.rl.http_client import ClientPool, RemoteCallError, RetryPolicy, call_json
from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.wire import (
    BaseUrl,
    GroupedRolloutCall,
    GroupedRolloutRequest,
    HealthResponse,
    RolloutGroup,
)


class RemoteEnvironmentError(RuntimeError):
    """An env server is unreachable or refused a request; the message names it."""


class RemoteAgentArgs(AgentArgs):
    """``agent_args`` of ``agent_type: remote``."""

    url: BaseUrl = Field(description="Base URL of the env server.")
    env_id: str | None = Field(None, description="Environment on the server (default: its mix).")
    single_turn: bool = Field(
        True,
        description="The environment sends the first generation request of every rollout at "
        "once, keyed, which lets the engine schedule deterministically (see "
        "ContinuousBatchingScheduler). True for single-turn environments and for multi-turn ones "
        "built on MultiTurnEnvironment or reward_only, whose later turns announce themselves.",
    )
    timeout_s: float = Field(900.0, gt=0, description="Read timeout of one group call.")
    connect_timeout_s: float = Field(5.0, gt=0, description="Connect timeout.")
    max_retries: int = Field(3, ge=0, le=20, description="Retries of a failed call.")
    backoff_s: float = Field(0.5, ge=0, description="First retry delay (doubles each retry).")
    max_connections: int = Field(64, ge=1, description="Pooled connections to the server.")
    api_key_env: str = Field(
        API_KEY_ENV,
        min_length=1,
        description="Environment variable whose value, when set, is sent as the bearer key the "
        "env server requires (the key itself never goes into a config file).",
    )


class RemoteAgent(Agent):
    """Forwards each group to an env server."""

    Args = RemoteAgentArgs
    args: RemoteAgentArgs
    requires_inference_server = True

    def __init__(self, env_id: str, args: RemoteAgentArgs | None = None) -> None:
        super().__init__(env_id, args)
        self.url = self.args.url.rstrip("/")
        self.retry = RetryPolicy(self.args.max_retries, self.args.backoff_s)
        self._client: ClientPool | None = None
        self._headers: dict[str, str] = {}

    async def astart(self) -> None:
        """Open the connection pool and check that the server hosts ``env_id``."""
        a = self.args
        self._headers = bearer_headers(os.environ.get(a.api_key_env))
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(a.timeout_s, connect=a.connect_timeout_s, pool=a.timeout_s),
            limits=httpx.Limits(
                max_connections=a.max_connections, max_keepalive_connections=a.max_connections
            ),
        )
        try:
            health = HealthResponse.model_validate(
                await call_json(
                    self._client,
                    "GET",
                    f"{self.url}/health",
                    policy=self.retry,
                    headers=self._headers,
                )
            )
        except (RemoteCallError, ValueError) as exc:
            raise RemoteEnvironmentError(f"env server {self.url} ({self.env_id}): {exc}") from None
        hosted = [e.env_id for e in health.environments]
        if a.env_id is not None and a.env_id not in hosted:
            raise RemoteEnvironmentError(
                f"env server {self.url} does not host env_id {a.env_id!r} (it hosts {hosted})"
            )

    def expected_requests(self, request: GroupedRolloutRequest) -> int | None:
        """One request per rollout when the remote environment is single-turn."""
        return request.group_size if self.args.single_turn else None

    async def group_rollout(
        self, request: GroupedRolloutRequest, inference: InferenceInterface
    ) -> RolloutGroup:
        """POST the group to the env server and validate its answer."""
        if self._client is None:
            raise RuntimeError(f"remote agent {self.env_id}: astart() was not called")
        if inference.base_url is None:
            raise RemoteEnvironmentError(
                f"remote agent {self.env_id}: the trainer's inference server is not running"
            )
        call = GroupedRolloutCall(
            request=request, inference_url=inference.base_url, env_id=self.args.env_id
        )
        url = f"{self.url}/v1/grouped_rollouts"
        try:
            payload = await call_json(self._client, "POST", url, call, self.retry, self._headers)
            return RolloutGroup.model_validate(payload)
        except RemoteCallError as exc:
            raise RemoteEnvironmentError(f"env server {self.url} ({self.env_id}): {exc}") from None
        except ValueError as exc:
            raise RemoteEnvironmentError(
                f"env server {self.url} ({self.env_id}) sent an invalid group: {exc}"
            ) from None

    async def aclose(self) -> None:
        """Close the connection pool."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None
