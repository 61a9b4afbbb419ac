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

Validation as NeMo-RL's ``validate_sync``: ``--val-split-fraction`` makes the held-out set of each
file-backed environment a partition training never draws from (``megatron/rl/agent/dataset.py``),
``--val-at-start`` / ``--val-at-end`` evaluate before the first and after the last step, the
``eval/*`` metrics include response lengths and the truncated share, and ``--val-dump-dir`` gets
each evaluation's rollouts as ``eval-v<policy version>.jsonl``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from megatron.rl.agent.api import Agent
from megatron.rl.agent.dataset import DatasetEnvironment
from megatron.rl.agent.mixture import MixtureAgent
from megatron.rl.eval.runner import EnvEvaluation, EvalConfig, eval_metrics, evaluate_agents
from megatron.rl.inference.interface import LocalInferenceInterface
from megatron.rl.inference.scheduler import SchedulerConfig
from megatron.rl.tokenizer import Tokenizer
from megatron.trainer.generation.host import GenerationHost
from megatron.trainer.parallel import ParallelContext
from megatron.trainer.tiers.base import Tier


def eval_agents(agent: Agent) -> list[Agent]:
    """The environments evaluated one by one: every entry of a mixture, evaluation-only ones
    (``weight: 0`` or ``evaluation_only: true``) included; remote ones are refused."""
    agents = agent.evaluated if isinstance(agent, MixtureAgent) else [agent]
    remote = [a.env_id for a in agents if a.requires_inference_server]
    if remote:
        raise SystemExit(
            f"pretrain_grpo.py: error: --env-config: environments {remote} generate through "
            "the trainer's inference server (the training engine); evaluation (--eval-interval, "
            "--val-at-start, --val-at-end, megatron.trainer.evaluate) supports in-process "
            "environments only"
        )
    return agents


def write_records(path: Path, results: list[EnvEvaluation], policy_version: int) -> None:
    """One JSON line per evaluated rollout (``runner.eval_record`` and the policy version);
    the file is replaced atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as out:
        for result in results:
            for record in result.records:
                out.write(json.dumps({"policy_version": policy_version, **record}) + "\n")
    os.replace(partial, path)


def hold_out_validation(agent: Agent, fraction: float) -> list[DatasetEnvironment]:
    """Split ``fraction`` of each trained file-backed environment's problems off as its
    validation partition (``--val-split-fraction``); the environments split."""
    trained = agent.agents if isinstance(agent, MixtureAgent) else [agent]
    split = [a for a in trained if isinstance(a, DatasetEnvironment)]
    if not split:
        raise SystemExit(
            "pretrain_grpo.py: error: --val-split-fraction: no trained environment is file-backed "
            f"(a DatasetEnvironment); environments: {[a.env_id for a in trained]}"
        )
    for env in split:
        try:
            env.hold_out(fraction)
        except ValueError as err:
            raise SystemExit(f"pretrain_grpo.py: error: --val-split-fraction: {err}") from None
    return split


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
        dump_dir: Path | None = None,
    ) -> None:
        self.ctx = ctx
        self.config = config
        self.dump_dir = dump_dir
        """Where rank 0 writes each evaluation's rollouts (None: nowhere)."""
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
        start = time.perf_counter()
        results = self.evaluate(policy_version)
        if not self.ctx.is_main:
            return {}
        return {
            **eval_metrics(results),
            "eval/policy_version": policy_version,
            "eval/seconds": time.perf_counter() - start,
        }

    def evaluate(self, policy_version: int) -> list[EnvEvaluation]:
        """Evaluate the current weights and dump the rollouts (``dump_path``); each
        environment's results on rank 0, [] elsewhere (collective)."""
        self.policy_version = policy_version
        if not self.ctx.is_main:
            self.host.window(None)
            return []
        results = self.host.window(self._evaluate)
        if self.dump_dir is not None:
            write_records(self.dump_path(policy_version), results, policy_version)
        return results

    def dump_path(self, policy_version: int) -> Path | None:
        """Where the evaluation at ``policy_version`` writes its rollouts (None: nowhere)."""
        if self.dump_dir is None:
            return None
        return self.dump_dir / f"eval-v{policy_version}.jsonl"

    async def _evaluate(self):
        return await evaluate_agents(self.agents, self.inference, self.config, self.host.engine)

    def close(self) -> None:
        """Stop the evaluation engine and close its event loop (rank 0); idempotent."""
        if self.ctx.is_main:
            self.host.close(self.host.engine.aclose)
