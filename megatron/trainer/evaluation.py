"""Periodic evaluation (``--eval-interval``): greedy reward and pass@k on a held-out prompt set.

Evaluation runs on its own engine: a second ``GenerationHost`` (``generation.py``) with the tier's
scheduler over its own step group and KV cache on the same model object, driven from its own event
loop, in a window of its own between two training steps (after the update of step s, so at policy
version s + 1). The training engine is suspended throughout and its
cache, queues and slots are untouched, so the training run's schedule, tokens, losses and staleness
are exactly those of a run without evaluation (the forced-lag contract does not see it). Sampling
uses no global RNG (each request has its own seeded stream), and evaluation requests are keyed and
announced on their own engine, so evaluation results are deterministic too. Remote environments are
refused: they generate through the trainer's inference server, i.e. the training engine.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from megatron.rl.agent.api import Agent
from megatron.rl.agent.mixture import MixtureAgent
from megatron.rl.eval.runner import EvalConfig, eval_metrics, evaluate_agents
from megatron.rl.inference.interface import LocalInferenceInterface
from megatron.rl.inference.scheduler import SchedulerConfig
from megatron.rl.tokenizer import Tokenizer
from megatron.trainer.generation import GenerationHost
from megatron.trainer.initialize import ParallelContext
from megatron.trainer.tiers.base import Tier


def eval_agents(agent: Agent) -> list[Agent]:
    """The environments evaluated one by one: every entry of a mixture, evaluation-only ones
    (``weight: 0`` or ``evaluation_only: true``) included."""
    agents = agent.evaluated if isinstance(agent, MixtureAgent) else [agent]
    remote = [a.env_id for a in agents if a.requires_inference_server]
    if remote:
        raise SystemExit(
            f"pretrain_grpo.py: error: --eval-interval: environments {remote} generate through "
            "the trainer's inference server (the training engine); evaluation supports "
            "in-process environments only"
        )
    return agents


class Evaluator:
    """Owns the evaluation engine; ``run`` is collective (every rank calls it)."""

    def __init__(
        self,
        ctx: ParallelContext,
        tier: Tier,
        model: torch.nn.Module,
        tokenizer: Tokenizer,
        agent: Agent | None,
        config: EvalConfig,
        engine_config: SchedulerConfig,
    ) -> None:
        self.ctx = ctx
        self.config = config
        self.policy_version = 0
        self.host = GenerationHost(
            ctx, tier, model, engine_config, tokenizer.vocab_size, lambda: self.policy_version
        )
        if ctx.is_main:
            if agent is None:
                raise ValueError("rank 0 needs the agent")
            self.agents = eval_agents(agent)
            self.inference = LocalInferenceInterface(self.host.engine, tokenizer)

    def run(self, policy_version: int) -> dict[str, Any]:
        """Evaluate the current weights; the ``eval/*`` metrics on rank 0, {} elsewhere."""
        self.policy_version = policy_version
        if not self.ctx.is_main:
            self.host.window(None)
            return {}
        start = time.perf_counter()
        results = self.host.window(self._evaluate)
        return {
            **eval_metrics(results),
            "eval/policy_version": policy_version,
            "eval/seconds": time.perf_counter() - start,
        }

    async def _evaluate(self):
        return await evaluate_agents(self.agents, self.inference, self.config, self.host.engine)

    def close(self) -> None:
        """Stop the evaluation engine and close its event loop (rank 0); idempotent."""
        if self.ctx.is_main:
            self.host.close(self.host.engine.aclose)
