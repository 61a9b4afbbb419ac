"""Fake inference and environments for tests of agents and servers."""

from __future__ import annotations

import asyncio
import math
import random

import httpx
import torch
from pydantic import Field

from megatron.rl.agent.api import Problem
from megatron.rl.environments.digits import DigitTaskArgs, DigitTaskEnvironment
from megatron.rl.inference.interface import InferenceInterface, render_chat
from megatron.rl.inference.protocol import InvalidInferenceRequest, RowResult
from megatron.rl.tokenizer import CharTokenizer
from megatron.rl.wire import InferenceRequest, InferenceResponse


class SeededInference(InferenceInterface):
    """Answers with 1-3 digits drawn from the request's seed (or EOS-only for empty draws).

    Records every request it receives; raises ``InvalidInferenceRequest`` for prompts with
    characters outside the tokenizer alphabet and for chat messages (the character tokenizer has
    no chat template), like the real interface.
    """

    def __init__(self) -> None:
        self.tokenizer = CharTokenizer()
        self.requests: list[InferenceRequest] = []

    async def generate(self, request: InferenceRequest) -> InferenceResponse:
        self.requests.append(request)
        if request.messages is not None:
            render_chat(self.tokenizer, request.messages)  # raises: no chat template
        try:
            prompt = request.prompt_tokens or self.tokenizer.encode(request.prompt)
            if request.prompt_suffix is not None:
                prompt = prompt + self.tokenizer.encode(request.prompt_suffix)
        except ValueError as exc:
            raise InvalidInferenceRequest(str(exc)) from None
        rng = random.Random(request.seed)
        n = min(rng.randint(1, 3), request.sampling.max_tokens - 1)
        text = "".join(rng.choice("0123456789") for _ in range(n))
        tokens = self.tokenizer.encode(text) + [self.tokenizer.eos_id]
        return InferenceResponse(
            prompt_tokens=prompt,
            tokens=tokens,
            text=text,
            logprobs=[-rng.random() for _ in tokens],
            policy_versions=[0] * len(tokens),
            finish_reason="stop",
        )


class FlakyDigits(DigitTaskEnvironment):
    """The digit task with bugs in its own code: drawing a problem whose answer starts with 9
    raises (a whole group is lost), and scoring a completion that starts with 7 raises (one
    rollout is lost)."""

    def make_problem(self, rng: random.Random) -> Problem:
        problem = super().make_problem(rng)
        if problem.answer.startswith("9"):
            raise RuntimeError(f"problem source failed on {problem.problem_id}")
        return problem

    def reward(self, problem: Problem, completion: str) -> float:
        if completion.startswith("7"):
            raise ValueError(f"cannot score {completion!r}")
        return super().reward(problem, completion)


def fake_route(seed: int, position: int) -> list[int]:
    """``FakeSteps``' route of the token a request of ``seed`` feeds at ``position``: 2 layers x
    top-2 expert ids, flat."""
    return [(seed * 7 + position * 3 + j) % 11 for j in range(4)]


class FakeSteps:
    """A ``StepGroup`` stand-in: records every plan and "samples" token 2 + (seed + position) % 7
    for each row (EOS, id 1, at the position ``eos_at[seed]`` if given); with ``routes``, each
    row's ``RowResult.routes`` are ``fake_route`` of the positions it fed, (n, 2, 2)."""

    def __init__(
        self, num_replicas: int = 1, eos_at: dict[int, int] | None = None, routes: bool = False
    ) -> None:
        self.num_replicas = num_replicas
        self.eos_at = eos_at or {}
        self.routes = routes
        self.plans = []
        self.fail_on_step: int | None = None

    def step(self, plan):
        self.plans.append(plan)
        if self.fail_on_step is not None and len(self.plans) > self.fail_on_step:
            raise RuntimeError("boom in forward")
        results = []
        for rows in plan.rows:
            out = []
            for row in rows:
                position = row.start + len(row.tokens)  # position of the sampled token
                eos = self.eos_at.get(row.seed) == position
                token = 1 if eos else 2 + (row.seed + position) % 7
                fed = range(row.start, position)
                routes = None
                if self.routes:
                    flat = [fake_route(row.seed, p) for p in fed]
                    routes = torch.tensor(flat, dtype=torch.int16).view(len(fed), 2, 2)
                out.append(
                    RowResult(slot=row.slot, token=token, logprob=-0.1 * position, routes=routes)
                )
            results.append(out)
        return results


class BrokenDigits(DigitTaskEnvironment):
    """The digit task whose problem source always fails."""

    def make_problem(self, rng: random.Random) -> Problem:
        raise RuntimeError("dataset shard missing")


class RaisingDigits(DigitTaskEnvironment):
    """The digit task whose ``group_rollout`` itself raises for one group in five (chosen by the
    request, so in-process and remote runs fail the same groups), before generating."""

    async def group_rollout(self, request, inference):
        if (request.batch_id * 7 + request.index_in_batch) % 5 == 0:
            raise KeyError(f"lost the state of group {request.batch_id}/{request.index_in_batch}")
        return await super().group_rollout(request, inference)


class SilentDigitsArgs(DigitTaskArgs):
    """``agent_args`` of ``SilentDigits``."""

    silent_from_batch: int = Field(1, ge=0, description="The first batch it never answers.")


class SilentDigits(DigitTaskEnvironment):
    """The digit task that stops answering: from batch ``silent_from_batch`` on its
    ``group_rollout`` awaits forever (an environment that hangs, not one that fails)."""

    Args = SilentDigitsArgs
    args: SilentDigitsArgs

    async def group_rollout(self, request, inference):
        if request.batch_id >= self.args.silent_from_batch:
            await asyncio.Event().wait()
        return await super().group_rollout(request, inference)


class NaNRewardDigits(DigitTaskEnvironment):
    """The digit task whose reward is NaN for every completion that starts with 3."""

    def reward(self, problem: Problem, completion: str) -> float:
        if completion.startswith("3"):
            return math.nan
        return super().reward(problem, completion)


class RaisingTransport(httpx.AsyncBaseTransport):
    """An httpx transport that raises ``error`` on every request: an exception, or an exception
    class built for the request (with the arguments httpx's classes need)."""

    def __init__(self, error: BaseException | type[Exception]) -> None:
        self.error = error
        self.calls = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        if isinstance(self.error, BaseException):
            raise self.error
        cls = self.error
        if issubclass(cls, httpx.HTTPStatusError):
            raise cls("boom", request=request, response=httpx.Response(500, request=request))
        if issubclass(cls, httpx.RequestError):
            raise cls("boom", request=request)
        if issubclass(cls, httpx.StreamError) and cls is not httpx.StreamError:
            raise cls()  # their constructors take no message
        raise cls("boom")
