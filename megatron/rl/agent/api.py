"""The agent API: how environments turn a ``GroupedRolloutRequest`` into a ``RolloutGroup``.

An ``Agent`` owns everything environment-specific: which prompt a group gets, how many turns it
takes, and the reward. It generates only through the ``InferenceInterface`` it is handed, so the
same agent runs in the trainer's process or behind the env server.

``SingleTurnEnvironment`` is the common case (prompt source + verifiable reward); built-in
environments subclass it. An exception raised by the environment's own code (``make_problem``,
``reward``) becomes a masked placeholder rollout carrying the error, so one bad sample never
stops training; an inference failure propagates, because the trainer cannot continue without it.

A single-turn environment's reward can instead come from reward functions (``reward_funcs`` of
its env-config entry, ``megatron/rl/agent/rewards``): a ``GroupScorer`` set as
``reward_functions`` scores the whole group at once (a reward model's batch, a judge's
concurrent calls), and each rollout carries the value of every function in
``reward_components``.
"""

from __future__ import annotations

import math
import random
import traceback
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

from pydantic import BaseModel, ConfigDict

from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.inference.protocol import InvalidInferenceRequest
from megatron.rl.seeding import derive_seed
from megatron.rl.wire import (
    ChatMessage,
    GroupedRolloutRequest,
    InferenceRequest,
    InferenceResponse,
    RolloutGroup,
    RolloutKey,
    SamplingParams,
    TokenRollout,
    check_chat_messages,
)


class AgentArgs(BaseModel):
    """Base of each agent's ``agent_args`` model (validated from the env-config YAML)."""

    model_config = ConfigDict(extra="forbid")


class Agent(ABC):
    """Produces one ``RolloutGroup`` per ``GroupedRolloutRequest``.

    Subclasses are built as ``cls(env_id, args)`` where ``args`` is an instance of ``cls.Args``
    (validated from the entry's ``agent_args`` in the env config).
    """

    Args: ClassVar[type[AgentArgs]] = AgentArgs
    """The pydantic model of this agent's ``agent_args``."""
    requires_inference_server: ClassVar[bool] = False
    """True when the agent generates out of process and needs the trainer's inference server
    (the ``InferenceInterface`` it is given then has a ``base_url``)."""
    required_modules: ClassVar[Mapping[str, str]] = {}
    """Optional packages the agent imports only when it runs (its data reader, its verifier):
    import name -> how to install it. The env config imports each one when it builds the agent,
    so a missing package stops the run at start-up instead of failing rollouts."""

    def __init__(self, env_id: str, args: AgentArgs | None = None) -> None:
        self.env_id = env_id
        self.args = args if args is not None else self.Args()

    @classmethod
    def create(cls, env_id: str, args: AgentArgs) -> Agent:
        """The agent of an env-config entry (``agent_args`` validated into ``args``):
        ``cls(env_id, args)``. A factory may return an agent of another class (the reward-model
        and judge environments return their prompt source's environment, scored by them)."""
        return cls(env_id, args)

    @abstractmethod
    async def group_rollout(
        self, request: GroupedRolloutRequest, inference: InferenceInterface
    ) -> RolloutGroup:
        """Run ``request.group_size`` rollouts of one prompt and return them as a group."""

    def expected_requests(self, request: GroupedRolloutRequest) -> int | None:
        """How many keyed generation requests the group sends at once when it starts.

        Agents that send all their first requests concurrently, each with its ``RolloutKey``,
        return that number so the engine can schedule deterministically; None (the default)
        opts out of the barrier. Announcing requests that never come stalls the engine until its
        barrier timeout, so only announce what is sent unconditionally.
        """
        return None

    async def astart(self) -> None:
        """Acquire resources and check remote dependencies before the first request."""

    async def aclose(self) -> None:
        """Release resources (connections, subprocesses). Default: nothing to release."""


@dataclass(frozen=True)
class Problem:
    """One prompt of a single-turn environment, with whatever the reward needs.

    The prompt is text (``prompt``) or a conversation (``messages``, with ``prompt=None``) that
    the trainer's tokenizer renders with its chat template; exactly one of them is given.
    """

    problem_id: str
    prompt: str | None
    answer: str
    max_tokens: int | None = None
    """Generation budget for this problem (None: the request's ``sampling.max_tokens``)."""
    messages: tuple[ChatMessage, ...] | None = None
    """The prompt as chat messages (instead of ``prompt``); ``{"role", "content"}`` dicts are
    validated into ``ChatMessage`` objects."""

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError(
                f"problem {self.problem_id}: give exactly one of 'prompt' and 'messages'"
            )
        if self.messages is not None:
            messages = tuple(ChatMessage.model_validate(m) for m in self.messages)
            check_chat_messages(list(messages))
            object.__setattr__(self, "messages", messages)  # frozen: set once, here


class RewardSourceError(RuntimeError):
    """A reward source that passed the config's checks cannot start (a reward model's weights
    do not load); the message names the environment and the field."""


class RewardFunctionError(Exception):
    """A reward function failed on a rollout; the message names the function and says why, and
    is the placeholder rollout's error text as it is (so the fault log reports each function's
    first error)."""


def problem_sampling(sampling: SamplingParams, problem: Problem) -> SamplingParams:
    """``sampling`` with the problem's own token budget, where it has one (validated: an
    environment cannot send a bad budget)."""
    if problem.max_tokens is None:
        return sampling
    return SamplingParams.model_validate(
        {**sampling.model_dump(), "max_tokens": problem.max_tokens}
    )


def placeholder_rollout(
    env_id: str, request: GroupedRolloutRequest, error: BaseException | str, problem_id: str = "?"
) -> TokenRollout:
    """A zero-weight stand-in for a rollout whose environment raised."""
    if isinstance(error, RewardFunctionError):
        text = str(error)
    elif isinstance(error, BaseException):
        text = "".join(traceback.format_exception_only(type(error), error)).strip()
    else:
        text = error
    return TokenRollout(
        env_id=env_id,
        problem_id=problem_id,
        prompt="",
        completion="",
        reward=0.0,
        error=text or "environment error",
        tokens=[],
        generation_mask=[],
        logprobs=[],
        policy_versions=[],
        submission_policy_version=request.submission_policy_version,
        temperature=request.sampling.temperature,
    )


@dataclass(frozen=True)
class Scored:
    """A rollout's reward from reward functions: the weighted sum and each function's value."""

    reward: float
    components: dict[str, float]


class GroupScorer(Protocol):
    """Scores the rollouts of one group together (``megatron.rl.agent.rewards``)."""

    async def score(
        self, problem: Problem, responses: list[InferenceResponse]
    ) -> list[Scored | BaseException]:
        """One ``Scored`` per response, or the exception that makes it a placeholder."""

    async def astart(self) -> None:
        """Load models, open clients."""

    async def aclose(self) -> None:
        """Release them."""


class SingleTurnEnvironment(Agent):
    """One prompt per group, one generation per rollout, a reward on the completion text.

    The prompt of a group is drawn from an RNG seeded by s = derive_seed(seed, batch_id,
    index_in_batch), and the group's samples are one ``generate_group`` request with seed s
    (sample k samples with derive_seed(s, k)), so a run is reproducible whatever the order in
    which generations finish, in process or over HTTP.

    With ``reward_functions`` set (an env-config entry's ``reward_funcs``) the group's rollouts
    are scored together by it instead of one ``reward`` call each.
    """

    reward_functions: GroupScorer | None = None
    """Scores the group in place of ``reward`` (None: ``reward`` scores each rollout)."""
    requires_reward_functions: ClassVar[bool] = False
    """True for an environment with no reward of its own: its entry must list ``reward_funcs``."""

    @abstractmethod
    def make_problem(self, rng: random.Random) -> Problem:
        """Draw one problem using only ``rng``."""

    @abstractmethod
    def reward(self, problem: Problem, completion: str) -> float:
        """Score ``completion`` for ``problem`` (typically in [0, 1])."""

    def expected_requests(self, request: GroupedRolloutRequest) -> int | None:
        """One keyed request per rollout, all sent together."""
        return request.group_size

    def problem_for(self, request: GroupedRolloutRequest) -> Problem:
        """The group's problem: ``make_problem`` with the RNG seeded by the request's place."""
        seed = derive_seed(request.seed, request.batch_id, request.index_in_batch)
        return self.make_problem(random.Random(seed))

    async def group_rollout(
        self, request: GroupedRolloutRequest, inference: InferenceInterface
    ) -> RolloutGroup:
        """Generate the group and score each rollout."""
        path = (request.batch_id, request.index_in_batch)
        try:
            problem = self.problem_for(request)
            sampling = problem_sampling(request.sampling, problem)
            group_request = InferenceRequest(
                prompt=problem.prompt,
                messages=None if problem.messages is None else list(problem.messages),
                sampling=sampling,
                seed=derive_seed(request.seed, *path),  # sample k: derive_seed(that, k)
                rollout_key=RolloutKey(batch_id=path[0], index_in_batch=path[1], sample_index=0),
            )
        except Exception as exc:  # the environment's own code failed: mask the whole group
            rollouts = [placeholder_rollout(self.env_id, request, exc)] * request.group_size
            return RolloutGroup(batch_id=path[0], index_in_batch=path[1], rollouts=rollouts)
        try:
            responses = await inference.generate_group(group_request, request.group_size)
        except InvalidInferenceRequest as exc:  # the prompt itself is unusable
            responses = [exc] * request.group_size
        if self.reward_functions is None:
            rollouts = [self._score(problem, r, request, sampling) for r in responses]
        else:
            rollouts = await self._score_together(problem, responses, request, sampling)
        return RolloutGroup(batch_id=path[0], index_in_batch=path[1], rollouts=rollouts)

    async def astart(self) -> None:
        """Start the reward functions (load a reward model, open a judge's client)."""
        if self.reward_functions is not None:
            try:
                await self.reward_functions.astart()
            except RewardSourceError as err:
                raise RewardSourceError(f"environment {self.env_id!r}: {err}") from None

    async def aclose(self) -> None:
        """Close the reward functions."""
        if self.reward_functions is not None:
            await self.reward_functions.aclose()

    async def _score_together(
        self,
        problem: Problem,
        responses: list[InferenceResponse | InvalidInferenceRequest],
        request: GroupedRolloutRequest,
        sampling: SamplingParams,
    ) -> list[TokenRollout]:
        """The group's rollouts scored by ``reward_functions`` in one call (the generated
        responses; an unusable prompt's are placeholders)."""
        generated = [r for r in responses if isinstance(r, InferenceResponse)]
        scores: list[Scored | BaseException] = []
        if generated:
            try:
                scores = await self.reward_functions.score(problem, generated)
            except Exception as exc:  # the reward functions failed as a whole
                scores = [exc] * len(generated)
        it = iter(scores)
        rollouts = []
        for response in responses:
            if not isinstance(response, InferenceResponse):
                rollouts.append(
                    placeholder_rollout(self.env_id, request, response, problem.problem_id)
                )
                continue
            scored = next(it)
            if isinstance(scored, BaseException):
                rollouts.append(
                    placeholder_rollout(self.env_id, request, scored, problem.problem_id)
                )
                continue
            rollouts.append(
                self._rollout(
                    problem, response, scored.reward, request, sampling, scored.components
                )
            )
        return rollouts

    def _score(
        self,
        problem: Problem,
        response: InferenceResponse | InvalidInferenceRequest,
        request: GroupedRolloutRequest,
        sampling: SamplingParams,
    ) -> TokenRollout:
        try:
            if isinstance(response, InvalidInferenceRequest):
                raise response
            reward = float(self.reward(problem, response.text))
            if not math.isfinite(reward):
                raise ValueError(f"reward is not finite: {reward}")
        except Exception as exc:
            return placeholder_rollout(self.env_id, request, exc, problem.problem_id)
        return self._rollout(problem, response, reward, request, sampling)

    def _rollout(
        self,
        problem: Problem,
        response: InferenceResponse,
        reward: float,
        request: GroupedRolloutRequest,
        sampling: SamplingParams,
        components: dict[str, float] | None = None,
    ) -> TokenRollout:
        return TokenRollout(
            env_id=self.env_id,
            problem_id=problem.problem_id,
            prompt=problem.prompt if problem.messages is None else response.prompt_text or "",
            completion=response.text,
            reward=reward,
            tokens=response.prompt_tokens + response.tokens,
            generation_mask=[False] * len(response.prompt_tokens) + [True] * len(response.tokens),
            logprobs=response.logprobs,
            policy_versions=response.policy_versions,
            submission_policy_version=request.submission_policy_version,
            temperature=sampling.temperature,
            max_tokens=sampling.max_tokens,
            turn_lengths=[len(response.tokens)],
            truncated=response.finish_reason == "length",
            reward_components=components,
            routed_experts=response.routed_experts,
        )
