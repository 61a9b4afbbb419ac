"""``agent_type: reward_only``: environments written for Megatron-LM's ``RewardOnlyAgent``, unchanged.

The environment is a plain class (it imports nothing of ours or of Megatron-LM's) with the
methods of Megatron-LM's reward-only agents, async or not::

    get_prompt(validation: bool) -> tuple[str, Any]              # prompt text, golden data
    get_reward(response: str, golden, finish_reason: str) -> float   # or (response, golden)
    evaluation_prompts(num_prompts: int, validation: bool) -> list[tuple[str, Any]]  # optional
    get_observation(turn_idx, response, conversation, golden) -> tuple[str | None, bool]
    get_trajectory_reward(responses, conversation, golden) -> float  # both optional: multi-turn

and is named in the env config with its constructor's keyword arguments::

    - agent_type: reward_only
      env_id: copy
      agent_args:
        env_class: examples/rl/my_env.py:CopyAgent   # or package.module:CopyAgent
        env_args: {max_digits: 3}                    # CopyAgent(max_digits=3)
        max_tokens: 8        # budget of each turn (default: --rl-default-max-tokens)
        max_turns: 1         # default: the class's ``max_turns`` attribute, else 1

A group calls ``get_prompt(validation=False)`` once; its ``group_size`` rollouts share the prompt.
Each rollout is an episode of up to ``max_turns`` model turns (``multi_turn.run_episode``): after
each turn but the last, ``get_observation`` returns ``(observation, done)`` and the observation
text is appended to the history, tokenized by the trainer's tokenizer (no chat template: the
prompt and observations are plain text). ``response`` objects have ``response.content``,
``response.role``, ``finish_reason``, ``token_ids`` (prompt and generation), ``prompt_length``,
``logprobs`` and ``raw_text``; ``conversation`` is a list of ``role``/``content`` messages. The
reward is ``get_trajectory_reward`` if defined, else ``get_reward`` on the last turn's text.
``golden["problem_id"]`` names the problem when golden is a mapping that has it. Held-out
evaluation (``--eval-interval``) takes problem i of ``evaluation_prompts(n, validation=True)``
when defined (n = ``--eval-prompts``), else calls ``get_prompt(validation=True)``.

Reproducibility. Our own environments draw each prompt from an RNG seeded by (seed, batch,
index); a Megatron-LM environment draws from the global ``random`` module (or numpy's). So every
call into the environment runs alone (per event loop), with ``random`` and numpy's global RNG
seeded from its place in the run (prompt: seed, batch, index; observation and reward: the
rollout's sample seed and turn), and the previous RNG states restored afterwards. Prompts,
observations and rewards then depend only on the seed and the rollout key: a run is
reproducible, in process equals behind the env server, and a resumed run continues exactly.
Limits: an environment whose choices come from elsewhere (its own ``random.Random`` instance,
torch's RNG, a dataset cursor advanced per call, time or I/O) is reproducible only as far as its
calls happen in the same order: in process they do (groups start in submission order and take
the lock in that order), behind the env server they follow the HTTP arrival order, and a resumed
run restarts its state. Calls into the environment never overlap, so slow ones (e.g. a remote
judge in ``get_reward``) serialize.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import Field, PrivateAttr, model_validator

from megatron.rl.agent.api import Agent, AgentArgs, placeholder_rollout
from megatron.rl.agent.multi_turn import TurnError, episode_rollout, run_episode
from megatron.rl.agent.user_code import call, load_class, positional_parameters, seeded
from megatron.rl.async_utils import gather_all
from megatron.rl.inference.interface import InferenceInterface, sample_request
from megatron.rl.inference.protocol import InvalidInferenceRequest
from megatron.rl.seeding import derive_seed
from megatron.rl.wire import (
    MAX_TOKENS,
    GroupedRolloutRequest,
    InferenceRequest,
    InferenceResponse,
    RolloutGroup,
    RolloutKey,
    SamplingParams,
    TokenRollout,
)

_PROMPT, _OBSERVATION, _REWARD, _EVAL_SET = 0x70, 0x6F, 0x72, 0x65  # RNG streams of the calls


@dataclass(frozen=True)
class ChatMessage:
    """A message as Megatron-LM's ``LLMChatMessage``: ``role`` and ``content``."""

    role: str
    content: str


@dataclass(frozen=True)
class TurnResponse:
    """One model turn, with the fields of Megatron-LM's ``InferenceResponse``."""

    response: ChatMessage
    raw_text: str
    token_ids: list[int]
    prompt_length: int
    logprobs: list[float]
    finish_reason: str
    completion_id: str


class RewardOnlyArgs(AgentArgs):
    """``agent_args`` of ``agent_type: reward_only``."""

    env_class: str = Field(
        description="The environment class: 'package.module:Class' or 'path/to/file.py:Class' "
        "(relative to the working directory)."
    )
    env_args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of its constructor."
    )
    max_tokens: int | None = Field(
        None, ge=1, le=MAX_TOKENS, description="Generation budget of each model turn."
    )
    max_turns: int | None = Field(
        None, ge=1, le=64, description="Model turns per rollout (default: the class's max_turns)."
    )
    _environment: Any = PrivateAttr(None)

    @model_validator(mode="after")
    def _build_environment(self) -> RewardOnlyArgs:
        cls = load_class(self.env_class)
        try:
            env = cls(**self.env_args)
        except Exception as exc:
            raise ValueError(
                f"{self.env_class}(**env_args) raised {type(exc).__name__}: {exc}"
            ) from None
        missing = [m for m in ("get_prompt", "get_reward") if not callable(getattr(env, m, None))]
        if missing:
            raise ValueError(f"{self.env_class} has no method {' or '.join(missing)}")
        turns = self.max_turns if self.max_turns is not None else getattr(env, "max_turns", 1)
        if not isinstance(turns, int) or turns < 1:
            raise ValueError(f"{self.env_class}.max_turns must be an int >= 1, got {turns!r}")
        if turns > 1 and not callable(getattr(env, "get_observation", None)):
            raise ValueError(f"max_turns={turns} needs a get_observation method")
        self.max_turns = turns
        self._environment = env
        return self


class RewardOnlyAdapter(Agent):
    """Runs a Megatron-LM style reward-only environment (see the module docstring)."""

    Args = RewardOnlyArgs
    args: RewardOnlyArgs

    def __init__(self, env_id: str, args: RewardOnlyArgs | None = None) -> None:
        super().__init__(env_id, args)
        self.environment = self.args._environment
        self.max_turns: int = self.args.max_turns
        self._reward_args = min(3, positional_parameters(self.environment.get_reward))
        self._eval_sets: dict[tuple[int, int], list] = {}

    def expected_requests(self, request: GroupedRolloutRequest) -> int | None:
        """Every rollout sends its first turn at once; later turns announce themselves."""
        return request.group_size

    async def group_rollout(
        self, request: GroupedRolloutRequest, inference: InferenceInterface
    ) -> RolloutGroup:
        """One prompt from the environment, ``group_size`` episodes of it, their rewards."""
        path = (request.batch_id, request.index_in_batch)
        sampling = request.sampling
        if self.args.max_tokens is not None:
            sampling = sampling.model_copy(update={"max_tokens": self.args.max_tokens})
        try:
            prompt, golden = await self._prompt(request)
        except Exception as exc:  # the environment's own code failed: mask the whole group
            rollouts = [placeholder_rollout(self.env_id, request, exc)] * request.group_size
            return RolloutGroup(batch_id=path[0], index_in_batch=path[1], rollouts=rollouts)
        problem_id = f"{self.env_id}:{path[0]}/{path[1]}"
        if isinstance(golden, Mapping) and "problem_id" in golden:
            problem_id = str(golden["problem_id"])
        first = InferenceRequest(
            prompt=prompt,
            sampling=sampling,
            seed=derive_seed(request.seed, *path),  # as SingleTurnEnvironment's samples
            rollout_key=RolloutKey(batch_id=path[0], index_in_batch=path[1], sample_index=0),
        )
        rollouts = await gather_all(
            *(
                self._rollout(
                    prompt,
                    golden,
                    problem_id,
                    sample_request(first, k),
                    request,
                    sampling,
                    inference,
                )
                for k in range(request.group_size)
            )
        )
        return RolloutGroup(batch_id=path[0], index_in_batch=path[1], rollouts=rollouts)

    async def _prompt(self, request: GroupedRolloutRequest) -> tuple[str, Any]:
        """``get_prompt`` (or the held-out set's problem ``batch_id``), seeded by its path."""
        env = self.environment
        if request.eval_prompts is not None and callable(getattr(env, "evaluation_prompts", None)):
            key = (request.seed, request.eval_prompts)
            async with seeded(derive_seed(request.seed, request.eval_prompts, _EVAL_SET)):
                if key not in self._eval_sets:
                    prompts = await call(env.evaluation_prompts, request.eval_prompts, True)
                    self._eval_sets[key] = list(prompts)
            held_out = self._eval_sets[key]
            if request.batch_id >= len(held_out):
                raise ValueError(
                    f"evaluation_prompts({request.eval_prompts}) returned {len(held_out)} prompts"
                )
            pair = held_out[request.batch_id]
        else:
            seed = derive_seed(request.seed, request.batch_id, request.index_in_batch, _PROMPT)
            async with seeded(seed):
                pair = await call(env.get_prompt, request.eval_prompts is not None)
        if not (isinstance(pair, tuple | list) and len(pair) == 2 and isinstance(pair[0], str)):
            raise TypeError(f"the environment's prompt must be a (str, golden) pair, got {pair!r}")
        if not pair[0]:
            raise ValueError("the environment's prompt is empty")
        return pair[0], pair[1]

    async def _rollout(
        self,
        prompt: str,
        golden: Any,
        problem_id: str,
        first: InferenceRequest,
        request: GroupedRolloutRequest,
        sampling: SamplingParams,
        inference: InferenceInterface,
    ) -> TokenRollout:
        env = self.environment
        conversation = [ChatMessage("user", prompt)]  # before the latest turn's reply

        async def respond(responses: list[InferenceResponse]) -> str | None:
            turn = len(responses) - 1
            async with seeded(derive_seed(first.seed, turn, _OBSERVATION)):
                answer = await call(
                    env.get_observation, turn, _turn(responses[-1]), list(conversation), golden
                )
            if not (isinstance(answer, tuple | list) and len(answer) == 2):
                raise TypeError(f"get_observation must return (observation, done), got {answer!r}")
            observation, done = answer
            if done:
                return None
            if not isinstance(observation, str) or not observation:
                raise ValueError(f"get_observation returned done=False with {observation!r}")
            conversation.extend(
                [ChatMessage("assistant", responses[-1].text), ChatMessage("user", observation)]
            )
            return observation

        try:
            episode = await run_episode(inference, first, self.max_turns, respond)
        except (InvalidInferenceRequest, TurnError) as exc:  # unusable turn, environment error
            return placeholder_rollout(self.env_id, request, exc.__cause__ or exc, problem_id)
        try:
            turns = [_turn(r) for r in episode.responses]
            async with seeded(derive_seed(first.seed, _REWARD)):
                if callable(getattr(env, "get_trajectory_reward", None)):
                    dialogue = [*conversation, turns[-1].response]
                    reward = await call(env.get_trajectory_reward, turns, dialogue, golden)
                else:
                    last = turns[-1]
                    reward_args = (last.response.content, golden, last.finish_reason)
                    reward = await call(env.get_reward, *reward_args[: self._reward_args])
            return episode_rollout(
                self.env_id, problem_id, prompt, episode, float(reward), request, sampling
            )
        except Exception as exc:  # the environment's reward failed
            return placeholder_rollout(self.env_id, request, exc, problem_id)


def _turn(response: InferenceResponse) -> TurnResponse:
    """The Megatron-LM view of one model turn."""
    return TurnResponse(
        response=ChatMessage("assistant", response.text),
        raw_text=response.text,
        token_ids=response.prompt_tokens + response.tokens,
        prompt_length=len(response.prompt_tokens),
        logprobs=response.logprobs,
        finish_reason=response.finish_reason,
        completion_id="",
    )
