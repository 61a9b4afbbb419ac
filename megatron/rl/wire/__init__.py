"""Pydantic wire types shared by the trainer, the agents, the env server and its clients.

Everything that crosses a process boundary (HTTP between the trainer and an env server or the
trainer's inference server, the pickled batch broadcast from rank 0 to the other ranks) is one of
these models, so server and client validate against the same definitions. Import them from here
(``from megatron.rl.wire import X``); the modules say what each holds:

* ``base``: the size limits, ``WireModel``, routing-replay routes, base URLs, the error body;
* ``messages``: chat messages and OpenAI's tool-call shapes;
* ``engine``: the engine-level request and response (``InferenceRequest``, ``InferenceResponse``);
* ``rollouts``: ``GroupedRolloutRequest``, ``Rollout``, ``TokenRollout``, ``RolloutGroup``;
* ``env_server``: the env server's health, grouped-rollout and evaluation messages;
* ``completions``: the inference server's ``/v1/completions``, ``/v1/rollouts/end`` and
  ``/v1/models``;
* ``chat``: the inference server's ``/v1/chat/completions`` and ``GET /metrics``;
* ``streaming``: the server-sent chunks of both endpoints' streamed answers.
"""

from megatron.rl.wire.base import (
    HTTP_URL_PATTERN,
    MAX_CHAT_MESSAGES,
    MAX_ID,
    MAX_ROUTE,
    MAX_TOKENS,
    BaseUrl,
    ErrorResponse,
    ExpertId,
    Routes,
    Seed,
    TokenId,
    WireModel,
    check_routes,
    parse_base_url,
)
from megatron.rl.wire.chat import (
    DEFAULT_MAX_TOKENS,
    FUNCTION_NAME_PATTERN,
    MAX_TOOLS,
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatTokenLogprob,
    ChatTopLogprob,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolCallMetrics,
    ToolChoice,
    ToolDefinition,
)
from megatron.rl.wire.completions import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionUsage,
    EndRolloutRequest,
    EndRolloutResponse,
    GeneratedChoice,
    ModelCard,
    ModelList,
    StreamOptions,
    choice_extensions,
    engine_response,
)
from megatron.rl.wire.engine import (
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    InferenceRequest,
    InferenceResponse,
    RolloutKey,
    SamplingParams,
    ScoreRequest,
    ScoreResponse,
    TokenAlternative,
)
from megatron.rl.wire.env_server import (
    EnvironmentInfo,
    EvaluationRequest,
    EvaluationResponse,
    EvaluationResult,
    GroupedRolloutCall,
    HealthResponse,
)
from megatron.rl.wire.messages import ChatMessage, ToolCall, ToolCallFunction, check_chat_messages
from megatron.rl.wire.rollouts import GroupedRolloutRequest, Rollout, RolloutGroup, TokenRollout
from megatron.rl.wire.streaming import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChunk,
    CompletionChunkChoice,
    ToolCallDelta,
    ToolCallFunctionDelta,
)

__all__ = [
    "MAX_ID",
    "MAX_TOKENS",
    "MAX_CHAT_MESSAGES",
    "Seed",
    "TokenId",
    "WireModel",
    "MAX_ROUTE",
    "ExpertId",
    "Routes",
    "check_routes",
    "HTTP_URL_PATTERN",
    "parse_base_url",
    "BaseUrl",
    "ErrorResponse",
    "ToolCallFunction",
    "ToolCall",
    "ChatMessage",
    "check_chat_messages",
    "SamplingParams",
    "RolloutKey",
    "InferenceRequest",
    "InferenceResponse",
    "MAX_TOP_LOGPROBS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_LENGTH",
    "TokenAlternative",
    "ScoreRequest",
    "ScoreResponse",
    "GroupedRolloutRequest",
    "Rollout",
    "TokenRollout",
    "RolloutGroup",
    "EnvironmentInfo",
    "HealthResponse",
    "GroupedRolloutCall",
    "EvaluationRequest",
    "EvaluationResult",
    "EvaluationResponse",
    "CompletionRequest",
    "EndRolloutRequest",
    "EndRolloutResponse",
    "CompletionLogprobs",
    "GeneratedChoice",
    "choice_extensions",
    "engine_response",
    "CompletionChoice",
    "CompletionUsage",
    "CompletionResponse",
    "ModelCard",
    "ModelList",
    "DEFAULT_MAX_TOKENS",
    "MAX_TOOLS",
    "FUNCTION_NAME_PATTERN",
    "FunctionDefinition",
    "ToolDefinition",
    "NamedFunction",
    "NamedToolChoice",
    "ToolChoice",
    "ChatCompletionRequest",
    "ChatCompletionMessage",
    "ChatTopLogprob",
    "ChatTokenLogprob",
    "ChatChoiceLogprobs",
    "ChatCompletionChoice",
    "ChatCompletionResponse",
    "ToolCallMetrics",
    "StreamOptions",
    "CompletionChunkChoice",
    "CompletionChunk",
    "ToolCallFunctionDelta",
    "ToolCallDelta",
    "ChatDelta",
    "ChatChunkChoice",
    "ChatCompletionChunk",
]
