"""The GRPO training loop: collect -> advantages -> train step -> log -> checkpoint.

Every rank runs this loop. Rank 0 also owns the rollout pipeline (agents, forced-lag generator,
inference engine) inside ``RolloutSource``; the other ranks take part in its engine steps and
receive each batch from it.
"""

from __future__ import annotations

import argparse
import time

from megatron.rl.agent.env_config import EnvConfigError, load_env_config
from megatron.rl.grpo.batch import build_train_batch
from megatron.rl.grpo.loss import GRPOLossConfig
from megatron.rl.inference.engine import LocalEngineConfig
from megatron.rl.rollout.generator import RolloutConfig
from megatron.rl.tokenizer import CharTokenizer
from megatron.rl.wire import SamplingParams
from megatron.training.checkpointing import load_checkpoint, save_checkpoint
from megatron.training.initialize import initialize_distributed, shutdown_distributed
from megatron.training.metrics import MetricsWriter, step_metrics
from megatron.training.model_provider import build_model
from megatron.training.optimizer import build_optimizer
from megatron.training.rollouts import RolloutSource
from megatron.training.train_step import train_step


def rollout_config(args: argparse.Namespace) -> RolloutConfig:
    """The generator's config from the flags."""
    return RolloutConfig(
        forced_lag=args.rl_forced_lag,
        groups_per_batch=args.grpo_prompts_per_step,
        group_size=args.grpo_group_size,
        seed=args.seed,
        sampling=SamplingParams(
            temperature=args.rl_default_temperature,
            top_p=args.rl_default_top_p,
            top_k=args.rl_default_top_k,
            max_tokens=args.rl_default_max_tokens,
        ),
    )


def train(args: argparse.Namespace) -> None:
    """Run GRPO for ``--train-iters`` steps (resuming from ``--load`` if given)."""
    try:  # fail on a bad env config before building anything
        agent = load_env_config(args.env_config)
    except EnvConfigError as err:
        raise SystemExit(f"pretrain_grpo.py: error: --env-config: {err}") from None
    ctx = initialize_distributed(args)
    try:
        tokenizer = CharTokenizer()
        model = build_model(args, tokenizer.vocab_size, ctx.device)
        optimizer, scheduler = build_optimizer(model, args)
        start = load_checkpoint(args.load, model, optimizer, scheduler, ctx) if args.load else 0
        loss_config = GRPOLossConfig(args.grpo_clamp_eps_lower, args.grpo_clamp_eps_upper)
        engine_config = LocalEngineConfig(
            max_requests=args.inference_max_requests // ctx.dp_size,
            max_seq_len=args.seq_length,
            eos_id=tokenizer.eos_id,
        )
        writer = (
            MetricsWriter(
                args.train_iters, args.log_interval, args.metrics_file, args.tensorboard_dir
            )
            if ctx.is_main
            else None
        )
        with RolloutSource(
            ctx,
            model,
            tokenizer,
            agent if ctx.is_main else None,
            rollout_config(args),
            engine_config,
            first_step=start,
        ) as rollouts:
            for step in range(start, args.train_iters):
                t0 = time.perf_counter()
                collected = rollouts.next_batch()
                batch = build_train_batch(collected.batch.groups, tokenizer.pad_id)
                result = train_step(
                    model,
                    optimizer,
                    scheduler,
                    batch,
                    args.micro_batch_size,
                    args.clip_grad,
                    loss_config,
                    tokenizer.vocab_size,
                    ctx,
                )
                rollouts.policy_version = step + 1
                if writer is not None:
                    writer.write(
                        step_metrics(
                            step, args.rl_forced_lag, collected, result, time.perf_counter() - t0
                        )
                    )
                if args.save and (step + 1) % (args.save_interval or args.train_iters) == 0:
                    save_checkpoint(args.save, step + 1, model, optimizer, scheduler, args, ctx)
        if writer is not None:
            writer.close()
    finally:
        shutdown_distributed()
