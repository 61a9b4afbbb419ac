"""Periodic evaluation (``--eval-interval``): greedy reward and pass@k on a held-out prompt set.

Evaluation runs on its own engine: a second engine of the tier (the local engine on CPU,
megatron-core's dynamic engine on CUDA) with its own KV cache and step group over the same model
object, driven from its own event loop, in a window of its own between two training steps (after the
update of step s, so at policy version s + 1). The training engine is suspended throughout and its
cache, queues and slots are untouched, so the training run's schedule, tokens, losses and staleness
are exactly those of a run without evaluation (the forced-lag contract does not see it). Sampling
uses no global RNG (each request has its own seeded stream), and evaluation requests are keyed and
announced on their own engine, so evaluation results are deterministic too. Remote environments are
refused: they generate through the trainer's inference server, i.e. the training engine.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import torch

from megatron.rl.agent.api import Agent
from megatron.rl.agent.mixture import MixtureAgent
from megatron.rl.eval.runner import EvalConfig, eval_metrics, evaluate_agents
from megatron.rl.inference.engine import LocalEngineConfig
from megatron.rl.inference.interface import LocalInferenceInterface
from megatron.rl.tokenizer import Tokenizer
from megatron.rl.wire import SamplingParams
from megatron.training.initialize import ParallelContext
from megatron.training.tiers import Tier


def eval_config(args: argparse.Namespace) -> EvalConfig:
    """The evaluation described by the flags (sampled pass at the training sampling params)."""
    return EvalConfig(
        num_prompts=args.eval_prompts,
        samples_per_prompt=args.eval_samples,
        pass_k=tuple(sorted(set(args.eval_pass_k))),
        sampling=SamplingParams(
            temperature=args.rl_default_temperature,
            top_p=args.rl_default_top_p,
            top_k=args.rl_default_top_k,
            max_tokens=args.rl_default_max_tokens,
        ),
        correct_threshold=args.eval_correct_threshold,
        seed=args.seed,
    )


def eval_agents(agent: Agent) -> list[Agent]:
    """The environments evaluated one by one (the entries of a mixture)."""
    agents = agent.agents if isinstance(agent, MixtureAgent) else [agent]
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
        engine_config: LocalEngineConfig,
    ) -> None:
        self.ctx = ctx
        self.model = model
        self.config = config
        self.policy_version = 0
        self.steps = tier.build_step_group(model, engine_config, tokenizer.vocab_size)
        self._loop: asyncio.AbstractEventLoop | None = None
        if ctx.is_main:
            if agent is None:
                raise ValueError("rank 0 needs the agent")
            self.agents = eval_agents(agent)
            self._loop = asyncio.new_event_loop()
            self.engine = tier.build_engine(self.steps, engine_config, lambda: self.policy_version)
            self.inference = LocalInferenceInterface(self.engine, tokenizer)
            self._loop.run_until_complete(self._start())

    async def _start(self) -> None:
        self.engine.start()

    def run(self, policy_version: int) -> dict[str, Any]:
        """Evaluate the current weights; the ``eval/*`` metrics on rank 0, {} elsewhere."""
        self.policy_version = policy_version
        self.model.eval()
        if not self.ctx.is_main:
            self.steps.follow()
            return {}
        start = time.perf_counter()
        try:
            results = self._loop.run_until_complete(self._evaluate())
        except BaseException as exc:
            self.steps.abort_followers(f"evaluation failed: {type(exc).__name__}: {exc}")
            raise
        self.steps.stop_followers()
        return {
            **eval_metrics(results),
            "eval/policy_version": policy_version,
            "eval/seconds": time.perf_counter() - start,
        }

    async def _evaluate(self):
        self.engine.resume()
        try:
            return await evaluate_agents(self.agents, self.inference, self.config, self.engine)
        finally:
            self.engine.suspend()

    def close(self) -> None:
        """Stop the evaluation engine and close its event loop (rank 0); idempotent."""
        if self._loop is None or self._loop.is_closed():
            return
        try:
            self._loop.run_until_complete(self.engine.aclose())
        finally:
            self._loop.close()
