"""Chat episodes: multi-turn rollouts over chat messages that never re-tokenize the model's tokens.

An episode is a conversation. Turn 0 is generated from the chat template's rendering of the
problem's messages (and tools); after each turn the environment answers with messages (tool
results, a user reply) or ends the episode. Turn t + 1's prompt is turn t's prompt tokens, the
tokens turn t generated, and the template's tokens for the environment's messages
(``InferenceRequest.suffix_messages``, rendered by the trainer: ``chat_continuation.py``), so
the training row is exactly the generated tokens plus the template's tokens around them::

    tokens           rendered messages | turn 0 | env messages 0 + gen. prompt | turn 1 | ...
    generation_mask  False             | True   | False                         | True   | ...

Rendering the conversation and encoding it again would not give the same row: decode -> encode
is not the identity (the model may sample ``a``, ``b`` where the tokenizer encodes ``ab``).

Determinism is that of ``multi_turn.py``: turn 0 of rollout k is sample k of the group's
request (its seed and key), turn t > 0 has seed derive_seed(turn 0's seed, t) and the same key,
every turn that may be followed by another is sent with ``continued=True``, and ``end_rollout``
releases the engine when the environment ends the episode early.

The environment sees each turn parsed (``ParsedMessage``: content and tool calls, by the
episode's tool-call parser); the episode counts turns, tool calls, tool errors (malformed calls,
and the tools that failed as the environment reports them) and whether limits cut it short.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron.rl.agent.multi_turn import Trajectory, TurnError, assemble_turns, turns_rollout
from megatron.rl.inference.interface import InferenceInterface, turn_request
from megatron.rl.tools.parsers import ParsedMessage, ToolCallParser
from megatron.rl.wire import (
    ChatMessage,
    GroupedRolloutRequest,
    InferenceRequest,
    InferenceResponse,
    SamplingParams,
    TokenRollout,
    ToolCall,
    ToolCallFunction,
)


@dataclass(frozen=True)
class ChatTurn:
    """One model turn: the engine's response and its text parsed into content and tool calls."""

    response: InferenceResponse
    parsed: ParsedMessage
    turn: int

    def message(self) -> ChatMessage:
        """The turn as an OpenAI assistant message (tool call ids ``call_<turn>_<i>``)."""
        calls = [
            ToolCall(
                id=call_id(self.turn, i),
                function=ToolCallFunction(name=c.name, arguments=json.dumps(c.arguments)),
            )
            for i, c in enumerate(self.parsed.tool_calls)
        ]
        return ChatMessage(role="assistant", content=self.parsed.content, tool_calls=calls or None)


def call_id(turn: int, index: int) -> str:
    """The id of tool call ``index`` of model turn ``turn`` (deterministic, unique per episode)."""
    return f"call_{turn}_{index}"


@dataclass(frozen=True)
class Reply:
    """The environment's answer to a turn: its messages and how many tools failed in them."""

    messages: Sequence[ChatMessage]
    tool_errors: int = 0
    """Tool calls whose tool raised or refused (their error went back as a tool message)."""


Respond = Callable[[list[ChatTurn]], Awaitable[Reply | None]]
"""The environment's answer to the turns so far (the latest is ``turns[-1]``); None ends it."""


@dataclass(frozen=True)
class ChatEpisode:
    """The turns of one chat rollout, the environment's replies, and its training row."""

    turns: list[ChatTurn]
    replies: list[Reply]
    """One after each turn but the last."""
    tokens: list[int]
    generation_mask: list[bool]
    logprobs: list[float]
    policy_versions: list[int]
    ended_by_environment: bool
    """False when the episode stopped at ``max_turns`` (the environment would have gone on)."""

    @property
    def truncated(self) -> bool:
        """A turn hit its token budget, or the episode hit its turn limit."""
        length = any(t.response.finish_reason == "length" for t in self.turns)
        return length or not self.ended_by_environment

    @property
    def metrics(self) -> dict[str, float]:
        """``TokenRollout.episode_metrics``: turns, tool calls, tool errors, truncated (0/1)."""
        malformed = sum(t.parsed.malformed for t in self.turns)
        return {
            "turns": float(len(self.turns)),
            "tool_calls": float(sum(len(t.parsed.tool_calls) for t in self.turns)),
            "tool_errors": float(malformed + sum(r.tool_errors for r in self.replies)),
            "truncated": float(self.truncated),
        }

    def messages(self) -> list[ChatMessage]:
        """The conversation after the prompt: assistant turns and the environment's messages."""
        out: list[ChatMessage] = []
        for i, turn in enumerate(self.turns):
            out.append(turn.message())
            if i < len(self.replies):
                out += self.replies[i].messages
        return out

    @property
    def transcript(self) -> str:
        """The conversation after the prompt as text, one ``role: content`` line per message."""
        return "\n".join(f"{m.role}: {m.content}" for m in self.messages())


async def run_chat_episode(
    inference: InferenceInterface,
    first: InferenceRequest,
    max_turns: int,
    respond: Respond,
    parser: ToolCallParser,
) -> ChatEpisode:
    """Alternate model turns (from ``first``, a request of ``messages``) and ``respond`` for at
    most ``max_turns`` model turns.

    An exception of ``respond`` (the environment's code) or a reply without messages ends the
    rollout in the engine and raises ``TurnError``; inference errors propagate as they are.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if first.messages is None:
        raise ValueError("a chat episode starts from a request of 'messages'")
    key = first.rollout_key
    request = first.model_copy(update={"continued": key is not None and max_turns > 1})
    turns: list[ChatTurn] = []
    replies: list[Reply] = []
    ended = False
    while True:
        response = await inference.generate(request)
        turns.append(ChatTurn(response, parser.parse(response.text), len(turns)))
        if len(turns) == max_turns:
            break
        try:
            reply = await respond(turns)
            if reply is not None and not reply.messages:
                raise ValueError("the environment's reply has no messages (None ends the episode)")
        except Exception as exc:
            if key is not None:
                await inference.end_rollout(key)
            raise TurnError(f"turn {len(turns) - 1}: {exc}") from exc
        if reply is None:
            ended = True
            if key is not None:
                await inference.end_rollout(key)
            break
        replies.append(reply)
        request = turn_request(
            reply.messages,
            response,
            turn=len(turns),
            max_turns=max_turns,
            sampling=first.sampling,
            seed=first.seed,
            key=key,
            tools=first.tools,
        )
    row = assemble_turns([t.response for t in turns])
    return ChatEpisode(
        turns, replies, row.tokens, row.generation_mask, row.logprobs, row.policy_versions, ended
    )


def chat_episode_rollout(
    env_id: str,
    problem_id: str,
    prompt: str,
    episode: ChatEpisode,
    reward: float,
    request: GroupedRolloutRequest,
    sampling: SamplingParams,
) -> TokenRollout:
    """The training rollout of a finished chat episode (its reward must be finite), with its
    ``episode_metrics``."""
    row = Trajectory(
        episode.tokens, episode.generation_mask, episode.logprobs, episode.policy_versions
    )
    responses = [t.response for t in episode.turns]
    return turns_rollout(
        env_id,
        problem_id,
        prompt,
        episode.transcript,
        responses,
        row,
        reward,
        request,
        sampling,
        episode.metrics,
    )


def prompt_text(messages: Sequence[ChatMessage], tools: list[dict[str, Any]] | None) -> str:
    """A rollout's ``prompt`` for a chat problem: the messages (and tool names) as text, the
    same in process and behind the env server (the rendered prompt is not on every wire)."""
    lines = [f"{m.role}: {m.content}" for m in messages]
    if tools:
        names = [str(t.get("function", {}).get("name", "?")) for t in tools]
        lines.insert(0, f"tools: {', '.join(names)}")
    return "\n".join(lines)
