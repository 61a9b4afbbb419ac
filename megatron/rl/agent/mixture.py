"""Several environments mixed by weight in every batch, deterministically by seed."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from functools import lru_cache

from megatron.rl.agent.api import Agent
from megatron.rl.inference.interface import InferenceInterface
from megatron.rl.seeding import derive_seed
from megatron.rl.wire import GroupedRolloutRequest, RolloutGroup

_MIXTURE_STREAM = 0x6D6978  # keeps the assignment RNG apart from prompt/sampling RNGs


def mixture_assignment(weights: tuple[float, ...], num_groups: int, seed: int) -> list[int]:
    """Which environment serves each group of a batch.

    Each environment gets ``weight / sum(weights) * num_groups`` groups rounded by largest
    remainder (ties to the earlier entry), so every batch has the same, weight-exact mix; the
    positions are then shuffled with an RNG seeded by ``seed``.
    """
    total = sum(weights)
    quotas = [w / total * num_groups for w in weights]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: num_groups - sum(counts)]:
        counts[i] += 1
    slots = [i for i, c in enumerate(counts) for _ in range(c)]
    random.Random(seed).shuffle(slots)
    return slots


class MixtureAgent(Agent):
    """Dispatches each group to one of ``agents`` according to ``mixture_assignment``.

    ``evaluation_only`` agents get no training groups; ``evaluated`` (every agent) are the
    environments of held-out evaluation. The mixture starts and closes all of them.
    """

    def __init__(
        self, agents: list[Agent], weights: list[float], evaluation_only: Sequence[Agent] = ()
    ) -> None:
        if not agents or len(agents) != len(weights):
            raise ValueError("MixtureAgent needs one positive weight per agent")
        if not all(math.isfinite(w) and w > 0 for w in weights):
            raise ValueError(f"MixtureAgent weights must be positive and finite, got {weights}")
        super().__init__(env_id="mixture")
        self.agents = agents
        self.weights = tuple(float(w) for w in weights)
        self.evaluation_only = list(evaluation_only)
        self._assignment = lru_cache(maxsize=64)(self._assign)
        self.requires_inference_server = any(a.requires_inference_server for a in agents)

    def _assign(self, seed: int, batch_id: int, groups_in_batch: int) -> list[int]:
        return mixture_assignment(
            self.weights, groups_in_batch, derive_seed(seed, batch_id, _MIXTURE_STREAM)
        )

    @property
    def evaluated(self) -> list[Agent]:
        """Every environment: the trained ones, then the evaluation-only ones."""
        return [*self.agents, *self.evaluation_only]

    def agent_for(self, request: GroupedRolloutRequest) -> Agent:
        """The agent that serves ``request``'s group."""
        slots = self._assignment(request.seed, request.batch_id, request.groups_in_batch)
        return self.agents[slots[request.index_in_batch]]

    def expected_requests(self, request: GroupedRolloutRequest) -> int | None:
        """What the assigned agent announces."""
        return self.agent_for(request).expected_requests(request)

    async def group_rollout(
        self, request: GroupedRolloutRequest, inference: InferenceInterface
    ) -> RolloutGroup:
        """Forward to the assigned agent."""
        return await self.agent_for(request).group_rollout(request, inference)

    async def astart(self) -> None:
        """Start every agent."""
        for agent in self.evaluated:
            await agent.astart()

    async def aclose(self) -> None:
        """Close every agent."""
        for agent in self.evaluated:
            await agent.aclose()
