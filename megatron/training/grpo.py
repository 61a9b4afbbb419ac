"""The GRPO training loop: collect -> advantages -> train step -> log -> checkpoint.

Every rank runs this loop. Rank 0 also owns the rollout pipeline (agents, forced-lag generator,
inference engine, and the inference server when remote environments need it) inside
``RolloutSource``; the other ranks take part in its engine steps and receive each batch from it.
"""

from __future__ import annotations

import argparse
import functools
import signal
import threading
import time

import torch

from megatron.rl.agent.api import Agent
from megatron.rl.agent.env_config import EnvConfigError, load_env_config
from megatron.rl.grpo.batch import build_train_batch
from megatron.rl.grpo.loss import GRPOLossConfig
from megatron.rl.inference.engine import LocalEngineConfig
from megatron.rl.rollout.generator import RolloutConfig
from megatron.rl.tokenizer import CharTokenizer, Tokenizer
from megatron.rl.wire import SamplingParams
from megatron.training.checkpointing import Checkpoint, load_checkpoint, save_checkpoint
from megatron.training.initialize import (
    ParallelContext,
    initialize_distributed,
    shutdown_distributed,
)
from megatron.training.metrics import MetricsWriter, step_metrics
from megatron.training.model_provider import build_model
from megatron.training.optimizer import build_optimizer
from megatron.training.rollouts import InferenceServerConfig, RolloutSource
from megatron.training.train_step import train_step


def train(args: argparse.Namespace) -> None:
    """Run GRPO for ``--train-iters`` steps (resuming from ``--load`` if given)."""
    agent = load_agent(args)
    ctx = initialize_distributed(args)
    writer = None
    try:
        tokenizer = CharTokenizer()
        model = build_model(args, tokenizer.vocab_size, ctx.device)
        optimizer, scheduler = build_optimizer(model, args)
        resumed = Checkpoint(iteration=0, pipeline=None)
        if args.load:
            resumed = load_checkpoint(args.load, model, optimizer, scheduler, args, ctx)
        step_fn = functools.partial(
            train_step, model, optimizer, scheduler, micro_batch_size=args.micro_batch_size,
            clip_grad=args.clip_grad, vocab_size=tokenizer.vocab_size, ctx=ctx,
            loss_config=GRPOLossConfig(args.grpo_clamp_eps_lower, args.grpo_clamp_eps_upper),
        )  # fmt: skip
        writer = metrics_writer(args) if ctx.is_main else None
        with rollout_source(args, ctx, model, tokenizer, agent, resumed) as rollouts:
            stop_on_signals(rollouts)
            for step in range(resumed.iteration, args.train_iters):
                t0 = time.perf_counter()
                collected = rollouts.next_batch()  # collect (ordered, forced lag)
                batch = build_train_batch(collected.batch.groups, tokenizer.pad_id)  # advantages
                result = step_fn(batch)  # train step: one optimizer update
                rollouts.policy_version = step + 1
                if writer is not None:  # log
                    elapsed = time.perf_counter() - t0
                    writer.write(step_metrics(step, args.rl_forced_lag, collected, result, elapsed))
                if checkpoint_due(args, step + 1):  # checkpoint (after draining the pipeline)
                    state = rollouts.drain()
                    save_checkpoint(
                        args.save, step + 1, model, optimizer, scheduler, state, args, ctx
                    )
    finally:
        if writer is not None:
            writer.close()
        shutdown_distributed()


def load_agent(args: argparse.Namespace) -> Agent:
    """The env-config's agents; a bad config exits before anything is built."""
    try:
        return load_env_config(args.env_config)
    except EnvConfigError as err:
        raise SystemExit(f"pretrain_grpo.py: error: --env-config: {err}") from None


def rollout_source(
    args: argparse.Namespace,
    ctx: ParallelContext,
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    agent: Agent,
    resumed: Checkpoint,
) -> RolloutSource:
    """The rollout pipeline described by the flags."""
    sampling = SamplingParams(
        temperature=args.rl_default_temperature,
        top_p=args.rl_default_top_p,
        top_k=args.rl_default_top_k,
        max_tokens=args.rl_default_max_tokens,
    )
    return RolloutSource(
        ctx,
        model,
        tokenizer,
        agent if ctx.is_main else None,
        RolloutConfig(
            forced_lag=args.rl_forced_lag,
            groups_per_batch=args.grpo_prompts_per_step,
            group_size=args.grpo_group_size,
            seed=args.seed,
            sampling=sampling,
        ),
        LocalEngineConfig(
            max_requests=args.inference_max_requests // ctx.dp_size,
            max_seq_len=args.seq_length,
            eos_id=tokenizer.eos_id,
        ),
        first_step=resumed.iteration,
        resume_from=resumed.pipeline,
        server_config=InferenceServerConfig(
            args.rl_inference_server_host, args.rl_inference_server_port
        ),
    )


def checkpoint_due(args: argparse.Namespace, iteration: int) -> bool:
    """Whether to save after ``iteration`` steps: every ``--save-interval`` and at the end."""
    if not args.save:
        return False
    return (
        iteration == args.train_iters or iteration % (args.save_interval or args.train_iters) == 0
    )


def metrics_writer(args: argparse.Namespace) -> MetricsWriter:
    """Log line, JSONL and TensorBoard outputs of the flags."""
    return MetricsWriter(
        args.train_iters, args.log_interval, args.metrics_file, args.tensorboard_dir
    )


def stop_on_signals(rollouts: RolloutSource) -> None:
    """SIGTERM/SIGINT end the run at the next safe point with exit status 128 + signum.

    The handler only records the request (an exception raised from a signal handler could land in
    any asyncio task, e.g. an HTTP handler that would swallow it); ``RolloutSource`` raises
    ``SystemExit`` and leaving its context shuts the pipeline down.
    """
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda s, frame: rollouts.request_stop(s))
