"""The env server: hosts the environments of an env-config YAML behind FastAPI.

    python -m megatron.rl.server.env_server --env-config envs.yaml --host 127.0.0.1 --port 8000

Endpoints (schema at ``/openapi.json``, docs at ``/docs``):

* ``GET /health``: status and the hosted environments.
* ``POST /v1/grouped_rollouts`` (``GroupedRolloutCall``): run one GRPO group. The environment
  generates through the trainer's inference server at ``inference_url``; the answer is the
  ``RolloutGroup`` exactly as an in-process agent would have produced it.
* ``POST /v1/evaluate`` (``EvaluationRequest``): score fresh problems of each environment
  (generation requests carry no rollout key, so they never enter the training schedule).

Faults: an invalid body is a 422 naming the field; an unknown ``env_id`` a 422; an environment
that raises gives a group of placeholder rollouts (HTTP 200, zero loss weight, error text kept;
the first traceback of each distinct error logged once per environment), the policy of
``megatron.rl.rollout.faults`` that in-process environments follow too; an inference server that
cannot be reached or fails gives 424 naming it. SIGTERM stops uvicorn
gracefully: in-flight requests finish, then agents and HTTP clients are closed.

The job's key goes with every call to an inference server: with ``--allowed-inference-url``
only to the origins listed there (scheme, host and port compared exactly, as httpx connects;
``megatron.rl.auth.Origin``), any other ``inference_url`` is a 403 before any connection.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import logging
import os
import signal
import statistics
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import uvicorn
from fastapi import FastAPI, HTTPException

from megatron.rl.agent.api import Agent
from megatron.rl.agent.env_config import EnvConfigError, load_env_config
from megatron.rl.agent.mixture import MixtureAgent
from megatron.rl.auth import (
    API_KEY_ENV,
    Origin,
    allowed_origins,
    listen_problem,
    may_receive_key,
    read_api_key,
    require_api_key,
)
from megatron.rl.http_client import ClientPool, RetryPolicy
from megatron.rl.inference.remote import RemoteInferenceInterface
from megatron.rl.rollout.faults import (
    INFRASTRUCTURE_ERRORS,
    FaultLog,
    run_group as faults_run_group,
)
from megatron.rl.server.http import ERROR_RESPONSES, install_error_handlers
from megatron.rl.server.limits import BodyLimit
from megatron.rl.wire import (
    EnvironmentInfo,
    EvaluationRequest,
    EvaluationResponse,
    EvaluationResult,
    GroupedRolloutCall,
    GroupedRolloutRequest,
    HealthResponse,
    RolloutGroup,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnvServerConfig:
    """How the env server talks to inference servers."""

    inference_timeout_s: float = 900.0
    """Read timeout of a completion call: longer than a training step plus a generation window,
    because the trainer answers only while it waits for a batch."""
    connect_timeout_s: float = 5.0
    """Connect timeout of a completion call."""
    max_connections: int = 512
    """Pooled connections to inference servers (all URLs together)."""
    retry: RetryPolicy = RetryPolicy()
    """Retries of a completion call that failed to connect or got a 5xx."""
    api_key: str | None = field(default=None, repr=False)
    """The job's shared key: required from clients (401 without it) and sent to inference
    servers (``megatron.rl.auth``); None accepts every request."""
    max_body_bytes: int = 8 << 20
    """Largest request body (413 above it, before it is read whole)."""
    allowed_inference_urls: tuple[str, ...] = ()
    """Origins (``scheme://host[:port]``) an ``inference_url`` must have (403 otherwise);
    empty allows any without a key, loopback origins only with one (the key is never sent
    off the machine unless an origin is listed)."""


def create_app(
    agent: MixtureAgent,
    config: EnvServerConfig = EnvServerConfig(),
    transport: httpx.AsyncBaseTransport | None = None,
) -> FastAPI:
    """The env server app hosting ``agent``'s environments.

    ``transport`` replaces the network for calls to inference servers (tests use an in-process
    ASGI transport); by default real connections are pooled in one ``httpx.AsyncClient``.
    """
    client: ClientPool | None = None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        nonlocal client
        timeout = httpx.Timeout(
            config.inference_timeout_s,
            connect=config.connect_timeout_s,
            pool=config.inference_timeout_s,
        )
        client = ClientPool(config.max_connections, timeout, transport)
        await agent.astart()
        try:
            yield
        finally:
            await agent.aclose()
            await client.aclose()
            logger.info("env server: environments and connections closed")

    app = FastAPI(title="megatron-rl env server", version="1", lifespan=lifespan)
    install_error_handlers(app)
    require_api_key(app, config.api_key)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    by_id = {a.env_id: a for a in agent.evaluated}
    faults = FaultLog(logger)
    allowed = allowed_origins(config.allowed_inference_urls)

    def select(env_id: str | None) -> Agent:
        if env_id is None:
            return agent
        if env_id not in by_id:
            raise HTTPException(
                422, f"field 'env_id': unknown environment {env_id!r}; " f"hosted: {sorted(by_id)}"
            )
        return by_id[env_id]

    def inference(url: str, keep_keys: bool = True) -> RemoteInferenceInterface:
        origin = Origin.of(url)  # the schema has parsed url already
        if not may_receive_key(origin, allowed, config.api_key is not None):
            which = (
                "its --allowed-inference-url"
                if allowed
                else ("with a key and no --allowed-inference-url, loopback servers only")
            )
            raise HTTPException(
                403,
                f"field 'inference_url': {origin} is not an inference server this env "
                f"server may call ({which})",
            )
        return RemoteInferenceInterface(url, client, config.retry, keep_keys, config.api_key)

    @app.get("/health", response_model=HealthResponse)
    async def health() -> HealthResponse:
        """Liveness and the hosted environments."""
        return HealthResponse(
            environments=[
                EnvironmentInfo(env_id=a.env_id, agent_type=type(a).__name__, weight=w)
                for a, w in zip(
                    agent.evaluated, agent.weights + (0.0,) * len(agent.evaluation_only)
                )
            ]
        )

    @app.post("/v1/grouped_rollouts", response_model=RolloutGroup, responses=ERROR_RESPONSES)
    async def grouped_rollouts(call: GroupedRolloutCall) -> RolloutGroup:
        """Run one group of rollouts through the caller's inference server."""
        env = select(call.env_id)
        return await run_group(env, call.request, inference(call.inference_url), faults)

    @app.post("/v1/evaluate", response_model=EvaluationResponse, responses=ERROR_RESPONSES)
    async def evaluate(body: EvaluationRequest) -> EvaluationResponse:
        """Score ``num_problems`` fresh problems per environment with the given sampling."""
        envs = [select(body.env_id)] if body.env_id is not None else agent.evaluated
        remote = inference(body.inference_url, keep_keys=False)
        results = []
        for env in envs:
            rewards, failed = [], 0
            for i in range(body.num_problems):
                request = GroupedRolloutRequest(
                    batch_id=i,
                    index_in_batch=0,
                    groups_in_batch=1,
                    group_size=1,
                    seed=body.seed,
                    submission_policy_version=0,
                    sampling=body.sampling,
                    eval_prompts=body.num_problems,
                )
                rollout = (await run_group(env, request, remote, faults)).rollouts[0]
                failed += rollout.is_placeholder
                rewards.append(rollout.reward)
            results.append(
                EvaluationResult(
                    env_id=env.env_id,
                    num_problems=body.num_problems,
                    reward_mean=statistics.fmean(rewards),
                    reward_std=statistics.pstdev(rewards),
                    failed=failed,
                )
            )
        return EvaluationResponse(results=results)

    return app


async def run_group(
    env: Agent,
    request: GroupedRolloutRequest,
    inference: RemoteInferenceInterface,
    faults: FaultLog,
) -> RolloutGroup:
    """``env.group_rollout`` under the shared fault policy; inference failures are a 424."""
    try:
        return await faults_run_group(env, request, inference, faults)
    except INFRASTRUCTURE_ERRORS as exc:
        raise HTTPException(424, str(exc)) from None


def main(argv: list[str] | None = None) -> None:
    """CLI: host an env-config under uvicorn until SIGTERM/SIGINT."""
    # Last at exit: the interpreter's shutdown then skips walking every object of torch and the
    # web stack with the garbage collector (reference counting still frees them).
    atexit.register(gc.freeze)
    parser = argparse.ArgumentParser(description="Serve RL environments over HTTP.")
    parser.add_argument(
        "--env-config",
        default=None,
        help="Env-config YAML (default: the built-in digit-copy task).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="Interface to listen on.")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    parser.add_argument(
        "--inference-timeout-s",
        type=float,
        default=900.0,
        help="Read timeout of calls to the trainer's inference server.",
    )
    parser.add_argument(
        "--max-request-body-mib",
        type=float,
        default=8.0,
        help="Largest request body, MiB (413 above it, before it is read whole).",
    )
    parser.add_argument("--log-level", default="info", help="uvicorn log level.")
    parser.add_argument(
        "--api-key-file",
        default=None,
        help=f"File holding the job's shared key, required from clients as a bearer token and "
        f"sent to inference servers (default: the environment variable {API_KEY_ENV}; "
        f"neither: no key).",
    )
    parser.add_argument(
        "--allowed-inference-url",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="Only generate through (and send the job's key to) inference servers at ORIGIN, "
        "scheme://host[:port]: scheme, host (any case) and port must equal it, a missing port "
        "is the scheme's default (repeatable; default: with a key, loopback servers only; "
        "without one, any).",
    )
    args = parser.parse_args(argv)
    try:
        allowed_origins(args.allowed_inference_url)
        agent = load_env_config(args.env_config)
        api_key = read_api_key(args.api_key_file, os.environ, "--api-key-file")
    except EnvConfigError as err:
        parser.exit(2, f"env_server: error: --env-config: {err}\n")
    except ValueError as err:
        parser.exit(2, f"env_server: error: {err}\n")
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    refused = listen_problem(args.host, api_key is not None, "--host", "--api-key-file")
    if refused:
        parser.exit(2, f"env_server: error: {refused}\n")
    config = EnvServerConfig(
        inference_timeout_s=args.inference_timeout_s,
        api_key=api_key,
        allowed_inference_urls=tuple(args.allowed_inference_url),
        max_body_bytes=int(args.max_request_body_mib * (1 << 20)),
    )
    app = create_app(agent, config)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it with the previous handler:
    # make that handler a clean exit.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    sys.exit(main())
