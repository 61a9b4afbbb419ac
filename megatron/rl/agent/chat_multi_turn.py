"""``ChatMultiTurnEnvironment``: multi-turn chat rollouts (tool use, dialogue) as an agent.

A problem is a conversation (``Problem.messages``) and optionally tools (OpenAI function
schemas, rendered by the chat template); the episode runs as in ``chat_episode.py`` and the
environment answers each parsed turn with messages. Failures are those of
``MultiTurnEnvironment``: the environment's own code raising (``make_problem``: the whole group;
``respond``, ``reward``: that rollout), or a turn the engine cannot serve, gives masked
placeholder rollouts.
"""

from __future__ import annotations

import random
from abc import abstractmethod
from typing import Any

from pydantic import Field, field_validator

from megatron.rl.agent.api import Agent, Problem, placeholder_rollout, problem_sampling
from megatron.rl.agent.chat_episode import (
    ChatEpisode,
    ChatTurn,
    Reply,
    chat_episode_rollout,
    prompt_text,
    run_chat_episode,
)
from megatron.rl.agent.multi_turn import MultiTurnArgs, TurnError
from megatron.rl.async_utils import gather_all
from megatron.rl.inference.interface import InferenceInterface, sample_request
from megatron.rl.inference.protocol import InvalidInferenceRequest
from megatron.rl.seeding import derive_seed
from megatron.rl.tools.parsers import PARSERS, tool_call_parser
from megatron.rl.wire import (
    GroupedRolloutRequest,
    InferenceRequest,
    RolloutGroup,
    RolloutKey,
    TokenRollout,
)


class ChatMultiTurnArgs(MultiTurnArgs):
    """``agent_args`` of a chat multi-turn environment (subclasses add their own fields)."""

    tool_call_parser: str = Field(
        "hermes",
        description="How the model writes tool calls (megatron/rl/tools/parsers.py): the "
        "format its chat template teaches.",
    )

    @field_validator("tool_call_parser")
    @classmethod
    def _known_parser(cls, value: str) -> str:
        if value not in PARSERS:
            raise ValueError(f"unknown tool-call parser {value!r}; known: {sorted(PARSERS)}")
        return value


class ChatMultiTurnEnvironment(Agent):
    """One conversation per group, several model turns per rollout, a reward per episode."""

    Args = ChatMultiTurnArgs
    args: ChatMultiTurnArgs

    @abstractmethod
    def make_problem(self, rng: random.Random) -> Problem:
        """Draw one problem (with ``messages``) using only ``rng``."""

    def tools(self, problem: Problem) -> list[dict[str, Any]] | None:
        """The OpenAI function schemas offered to the model (default: none)."""
        return None

    @abstractmethod
    async def respond(self, problem: Problem, turns: list[ChatTurn]) -> Reply | None:
        """The answer to the latest turn (``turns[-1].parsed``); None ends the episode."""

    @abstractmethod
    async def reward(self, problem: Problem, episode: ChatEpisode) -> float:
        """Score the episode."""

    def expected_requests(self, request: GroupedRolloutRequest) -> int | None:
        """Every rollout sends its first turn at once; later turns announce themselves."""
        return request.group_size

    async def group_rollout(
        self, request: GroupedRolloutRequest, inference: InferenceInterface
    ) -> RolloutGroup:
        """Run ``group_size`` episodes of one problem concurrently and score them."""
        path = (request.batch_id, request.index_in_batch)
        seed = derive_seed(request.seed, *path)
        try:
            problem = self.make_problem(random.Random(seed))
            if problem.messages is None:
                raise ValueError(f"problem {problem.problem_id!r} has no chat messages")
            sampling = problem_sampling(request.sampling, problem)
            tools = self.tools(problem)
            first = InferenceRequest(
                messages=list(problem.messages),
                tools=tools,
                sampling=sampling,
                seed=seed,
                rollout_key=RolloutKey(batch_id=path[0], index_in_batch=path[1], sample_index=0),
            )
        except Exception as exc:  # the environment's own code failed: mask the whole group
            rollouts = [placeholder_rollout(self.env_id, request, exc)] * request.group_size
            return RolloutGroup(batch_id=path[0], index_in_batch=path[1], rollouts=rollouts)
        prompt = prompt_text(problem.messages, tools)
        rollouts = await gather_all(
            *(
                self._rollout(problem, prompt, sample_request(first, k), request, inference)
                for k in range(request.group_size)
            )
        )
        return RolloutGroup(batch_id=path[0], index_in_batch=path[1], rollouts=rollouts)

    async def _rollout(
        self,
        problem: Problem,
        prompt: str,
        first: InferenceRequest,
        request: GroupedRolloutRequest,
        inference: InferenceInterface,
    ) -> TokenRollout:
        async def respond(turns: list[ChatTurn]) -> Reply | None:
            return await self.respond(problem, turns)

        parser = tool_call_parser(self.args.tool_call_parser)
        try:
            episode = await run_chat_episode(inference, first, self.args.max_turns, respond, parser)
        except (InvalidInferenceRequest, TurnError) as exc:  # unusable turn, environment error
            return placeholder_rollout(
                self.env_id, request, exc.__cause__ or exc, problem.problem_id
            )
        try:
            reward = float(await self.reward(problem, episode))
            return chat_episode_rollout(
                self.env_id, problem.problem_id, prompt, episode, reward, request, first.sampling
            )
        except Exception as exc:  # the environment's reward failed
            return placeholder_rollout(self.env_id, request, exc, problem.problem_id)
