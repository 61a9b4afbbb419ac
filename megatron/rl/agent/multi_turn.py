"""Multi-turn rollouts: the model and the environment take turns, up to ``max_turns`` model turns.

Turn 0 generates from the problem's prompt. After each turn but the last possible one the
environment answers with an observation (feedback, a tool result) or ends the episode. The next
turn's prompt is the whole history (every token the model saw and generated, EOS included) plus
the observation, which the trainer's tokenizer tokenizes (``InferenceRequest.prompt_suffix``: an
environment behind the env server never needs the tokenizer). So a rollout is one training row
that is exactly what the model was conditioned on::

    tokens           prompt | turn 0 | observation 0 | turn 1 | ...
    generation_mask  False  | True   | False         | True   | ...

and only the model's tokens carry loss; ``logprobs`` and ``policy_versions`` cover the generated
tokens of every turn (a later turn may be generated at a later policy version than the first;
submission staleness is that of the group).

Determinism. Turn 0 of rollout k is sample k of a single-turn group: seed derive_seed(s, k)
with s = derive_seed(seed, batch_id, index_in_batch), key (batch_id, index_in_batch, k); turn t
> 0 has seed derive_seed(that, t) and the same key. Every turn that may be followed by another
is sent with ``continued=True``, and ``end_rollout`` tells the engine when the environment ends
the episode early, so the engine waits for each next turn (its barrier) and admits it at a fixed
step whatever the environment's latency, in process or over HTTP. Each rollout runs as its own
task and sends its own requests (an ``n``-sample call would finish only with its slowest sample,
while the barrier waits for the next turn of the fastest one).
"""

from __future__ import annotations

import math
import random
from abc import abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pydantic import Field

from megatron.rl.agent.api import Agent, AgentArgs, Problem, placeholder_rollout, problem_sampling
from megatron.rl.async_utils import gather_all
from megatron.rl.inference.interface import InferenceInterface, sample_request, turn_request
from megatron.rl.inference.protocol import InvalidInferenceRequest
from megatron.rl.seeding import derive_seed
from megatron.rl.wire import (
    GroupedRolloutRequest,
    InferenceRequest,
    InferenceResponse,
    RolloutGroup,
    RolloutKey,
    SamplingParams,
    TokenRollout,
)

Respond = Callable[[list[InferenceResponse]], Awaitable[str | None]]
"""The environment's answer to the turns so far: an observation, or None to end the episode."""


class TurnError(Exception):
    """The environment's code failed to answer a turn; ``__cause__`` is what it raised."""


@dataclass(frozen=True)
class Episode:
    """The turns of one rollout, and its trajectory as one token sequence."""

    responses: list[InferenceResponse]
    """One per model turn; ``prompt_tokens`` of turn t is the history it was generated from."""
    observations: list[str]
    """The environment's answer after each turn but the last."""
    tokens: list[int]
    generation_mask: list[bool]
    logprobs: list[float]
    policy_versions: list[int]

    @property
    def completions(self) -> list[str]:
        """The text of each model turn."""
        return [r.text for r in self.responses]

    @property
    def transcript(self) -> str:
        """Everything after the prompt as text: turn 0, observation 0, turn 1, ..."""
        parts = [self.responses[0].text]
        for observation, response in zip(self.observations, self.responses[1:]):
            parts += [observation, response.text]
        return "".join(parts)


async def run_episode(
    inference: InferenceInterface, first: InferenceRequest, max_turns: int, respond: Respond
) -> Episode:
    """Alternate model turns and ``respond`` from ``first`` (turn 0's request) for at most
    ``max_turns`` model turns; see the module docstring for seeds and the engine schedule.

    An exception of ``respond`` (the environment's code), or an observation that is not
    non-empty text, ends the rollout in the engine and raises ``TurnError``; inference errors
    propagate as they are.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    key = first.rollout_key
    request = first.model_copy(update={"continued": key is not None and max_turns > 1})
    responses: list[InferenceResponse] = []
    observations: list[str] = []
    while True:
        responses.append(await inference.generate(request))
        if len(responses) == max_turns:
            break
        try:
            observation = await respond(responses)
            if observation is not None and not (isinstance(observation, str) and observation):
                raise ValueError(
                    f"the environment's observation must be non-empty text or None (the end of "
                    f"the episode), got {observation!r}"
                )
        except Exception as exc:
            if key is not None:
                await inference.end_rollout(key)
            raise TurnError(f"turn {len(responses) - 1}: {exc}") from exc
        if observation is None:
            if key is not None:
                await inference.end_rollout(key)
            break
        observations.append(observation)
        request = turn_request(
            observation,
            responses[-1],
            turn=len(responses),
            max_turns=max_turns,
            sampling=first.sampling,
            seed=first.seed,
            key=key,
        )
    return _assemble(responses, observations)


@dataclass(frozen=True)
class Trajectory:
    """The turns of a rollout as one training row (see the module docstring)."""

    tokens: list[int]
    generation_mask: list[bool]
    logprobs: list[float]
    """One per generated token, as ``policy_versions``."""
    policy_versions: list[int]


def assemble_turns(responses: list[InferenceResponse]) -> Trajectory:
    """One row of the turns: each turn's prompt must extend the history so far (prompt and
    earlier turns); what it adds (the environment's tokens) is masked, its generated tokens are
    not. ``ValueError`` when a prompt does not extend the history."""
    tokens = list(responses[0].prompt_tokens)
    mask = [False] * len(tokens)
    logprobs: list[float] = []
    versions: list[int] = []
    for turn, response in enumerate(responses):
        if response.prompt_tokens[: len(tokens)] != tokens:
            raise ValueError(f"the prompt of turn {turn} does not extend the episode's history")
        observed = response.prompt_tokens[len(tokens) :]
        tokens += observed + response.tokens
        mask += [False] * len(observed) + [True] * len(response.tokens)
        logprobs += response.logprobs
        versions += response.policy_versions
    return Trajectory(tokens, mask, logprobs, versions)


def assemble_routes(responses: list[InferenceResponse]) -> list[list[int]] | None:
    """The routes of the turns' row (``assemble_turns``) at every input position: each position
    takes the route of the first turn that fed it (turn 0's whole record, then what each later
    turn's prompt added and its generated tokens but the last). None unless every turn has one."""
    if any(r.routed_experts is None for r in responses):
        return None
    routes: list[list[int]] = []
    for response in responses:  # a turn feeds prompt + tokens[:-1]; the earlier ones come first
        routes += response.routed_experts[len(routes) :]
    return routes


def _assemble(responses: list[InferenceResponse], observations: list[str]) -> Episode:
    row = assemble_turns(responses)
    return Episode(
        responses, observations, row.tokens, row.generation_mask, row.logprobs, row.policy_versions
    )


def turns_rollout(
    env_id: str,
    problem_id: str,
    prompt: str,
    completion: str,
    responses: list[InferenceResponse],
    row: Trajectory,
    reward: float,
    request: GroupedRolloutRequest,
    sampling: SamplingParams,
    episode_metrics: dict[str, float] | None = None,
) -> TokenRollout:
    """The training rollout of the model turns ``responses`` assembled as ``row`` (its reward must
    be finite): what text, chat and agent episodes share."""
    if not math.isfinite(reward):
        raise ValueError(f"reward is not finite: {reward}")
    return TokenRollout(
        env_id=env_id,
        problem_id=problem_id,
        prompt=prompt,
        completion=completion,
        reward=reward,
        tokens=row.tokens,
        generation_mask=row.generation_mask,
        logprobs=row.logprobs,
        policy_versions=row.policy_versions,
        submission_policy_version=request.submission_policy_version,
        temperature=sampling.temperature,
        max_tokens=sampling.max_tokens,
        turn_lengths=[len(r.tokens) for r in responses],
        truncated=any(r.finish_reason == "length" for r in responses),
        episode_metrics=episode_metrics,
        routed_experts=assemble_routes(responses),
    )


def episode_rollout(
    env_id: str,
    problem_id: str,
    prompt: str,
    episode: Episode,
    reward: float,
    request: GroupedRolloutRequest,
    sampling: SamplingParams,
) -> TokenRollout:
    """The training rollout of a finished episode (its reward must be finite)."""
    row = Trajectory(
        episode.tokens, episode.generation_mask, episode.logprobs, episode.policy_versions
    )
    return turns_rollout(
        env_id,
        problem_id,
        prompt,
        episode.transcript,
        episode.responses,
        row,
        reward,
        request,
        sampling,
    )


class MultiTurnArgs(AgentArgs):
    """``agent_args`` of a multi-turn environment (subclasses add their own fields)."""

    max_turns: int = Field(4, ge=1, le=64, description="Most model turns per rollout.")


class MultiTurnEnvironment(Agent):
    """One problem per group, several model turns per rollout, a reward on the whole episode.

    The problem is drawn as in ``SingleTurnEnvironment`` (an RNG seeded by (seed, batch_id,
    index_in_batch); ``Problem.max_tokens`` is the budget of each turn). An exception of the
    environment's own code (``make_problem``: the whole group; ``observe``, ``reward``: that
    rollout) gives masked placeholder rollouts, as for single-turn environments, and so does a
    turn the engine cannot serve (e.g. a history that outgrew the sequence length).
    """

    Args = MultiTurnArgs
    args: MultiTurnArgs

    @abstractmethod
    def make_problem(self, rng: random.Random) -> Problem:
        """Draw one problem using only ``rng``."""

    @abstractmethod
    async def observe(self, problem: Problem, completions: list[str]) -> str | None:
        """The answer to the model's latest turn (``completions[-1]``); None ends the episode."""

    @abstractmethod
    async def reward(self, problem: Problem, completions: list[str]) -> float:
        """Score the episode from the text of its model turns."""

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
            sampling = problem_sampling(request.sampling, problem)
        except Exception as exc:  # the environment's own code failed: mask the whole group
            rollouts = [placeholder_rollout(self.env_id, request, exc)] * request.group_size
            return RolloutGroup(batch_id=path[0], index_in_batch=path[1], rollouts=rollouts)
        first = InferenceRequest(
            prompt=problem.prompt,
            sampling=sampling,
            seed=seed,
            rollout_key=RolloutKey(batch_id=path[0], index_in_batch=path[1], sample_index=0),
        )
        rollouts = await gather_all(
            *(
                self._rollout(problem, sample_request(first, k), request, sampling, inference)
                for k in range(request.group_size)
            )
        )
        return RolloutGroup(batch_id=path[0], index_in_batch=path[1], rollouts=rollouts)

    async def _rollout(
        self,
        problem: Problem,
        first: InferenceRequest,
        request: GroupedRolloutRequest,
        sampling: SamplingParams,
        inference: InferenceInterface,
    ) -> TokenRollout:
        async def respond(responses: list[InferenceResponse]) -> str | None:
            return await self.observe(problem, [r.text for r in responses])

        try:
            episode = await run_episode(inference, first, self.args.max_turns, respond)
        except (InvalidInferenceRequest, TurnError) as exc:  # unusable turn, environment error
            return placeholder_rollout(
                self.env_id, request, exc.__cause__ or exc, problem.problem_id
            )
        try:
            reward = float(await self.reward(problem, episode.completions))
            return episode_rollout(
                self.env_id, problem.problem_id, problem.prompt, episode, reward, request, sampling
            )
        except Exception as exc:  # the environment's reward failed
            return placeholder_rollout(self.env_id, request, exc, problem.problem_id)
