"""Flags to typed configs: the one place that reads the parsed flags for the RL library.

``arguments.py`` builds the parser of every flag (each declared once, with its one default, in
its group's ``*_flags.py``) and ``flag_validation.py`` validates them;
``megatron.rl`` takes only the typed configs built here. The model and optimizer flags are mapped
to megatron-core's configs by ``model_provider.py`` and ``optimizer.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from megatron.rl.auth import API_KEY_ENV, read_api_key
from megatron.rl.eval.runner import EvalConfig
from megatron.rl.grpo.filtering import DynamicSamplingConfig
from megatron.rl.grpo.importance import ImportanceConfig
from megatron.rl.grpo.loss import GRPOLossConfig
from megatron.rl.grpo.seq_logprob_error import SeqLogprobErrorConfig
from megatron.rl.grpo.terms import LossTerm, loss_terms
from megatron.rl.inference.scheduler import SchedulerConfig
from megatron.rl.models.hf import HFCheckpointError, load_hf_tokenizer
from megatron.rl.rollout.faults import FailureBudget
from megatron.rl.rollout.generator import RolloutConfig
from megatron.rl.tokenizer import CharTokenizer, HuggingFaceTokenizer, Tokenizer
from megatron.rl.wire import SamplingParams
from megatron.trainer.checkpointing import saved_args
from megatron.trainer.metrics import WandbConfig
from megatron.trainer.rollouts import InferenceServerConfig
from megatron.trainer.step import StepConfig


def enabled_terms(args: argparse.Namespace) -> tuple[LossTerm, ...]:
    """The loss terms whose weight flag is not 0 (``megatron/rl/grpo/terms``)."""
    terms = []
    for term in loss_terms():
        weight = getattr(args, term.flag.lstrip("-").replace("-", "_"))
        if weight != 0.0:
            terms.append(term(weight))
    return tuple(terms)


def loss_config(args: argparse.Namespace) -> GRPOLossConfig:
    """Clipping and the additive terms of the loss."""
    return GRPOLossConfig(
        clamp_eps_lower=args.grpo_clamp_eps_lower,
        clamp_eps_upper=args.grpo_clamp_eps_upper,
        terms=enabled_terms(args),
    )


def step_config(args: argparse.Namespace, vocab_size: int) -> StepConfig:
    """The train step: loss, micro-batching, clipping, iterations, IS correction, packing."""
    importance = None
    if args.rl_inference_logprobs_is_correction:
        importance = ImportanceConfig(args.rl_importance_sampling_truncation_coef)
    return StepConfig(
        loss=loss_config(args),
        vocab_size=vocab_size,
        micro_batch_size=args.micro_batch_size,
        clip_grad=args.clip_grad,
        old_logprobs=args.grpo_iterations > 1,
        importance=importance,
        packing_capacity=args.seq_length if args.rl_use_sequence_packing else None,
        check_finite=args.check_for_nan_in_loss_and_grad,
    )


def seq_logprob_error_config(args: argparse.Namespace) -> SeqLogprobErrorConfig | None:
    """The sequence-level logprob error of ``--rl-log-seq-logprob-error`` (metrics) and
    ``--rl-seq-logprob-error-threshold`` (masking; implies the metrics); None when off."""
    threshold = args.rl_seq_logprob_error_threshold
    if threshold is None and not args.rl_log_seq_logprob_error:
        return None
    return SeqLogprobErrorConfig(threshold)


def generation_rounds(args: argparse.Namespace) -> int:
    """Rounds of groups generated per batch (> 1 only with dynamic sampling)."""
    return args.grpo_max_generation_rounds if args.grpo_filter_groups_with_same_reward else 1


def dynamic_sampling_config(args: argparse.Namespace) -> DynamicSamplingConfig | None:
    """Dynamic sampling of ``--grpo-filter-groups-with-same-reward`` (None when off)."""
    if not args.grpo_filter_groups_with_same_reward:
        return None
    return DynamicSamplingConfig(args.grpo_prompts_per_step, generation_rounds(args))


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The default sampling of every generation request (Megatron-LM's "off" values: top-p 0,
    top-k -1, become ours: 1 and 0)."""
    return SamplingParams(
        temperature=args.rl_default_temperature,
        top_p=args.rl_default_top_p if args.rl_default_top_p > 0 else 1.0,
        top_k=max(args.rl_default_top_k, 0),
        max_tokens=args.rl_default_max_tokens,
        ignore_eos=args.rl_ignore_eos,
    )


def rollout_config(args: argparse.Namespace) -> RolloutConfig:
    """What the forced-lag generator submits, and how far ahead: dynamic sampling's rounds all
    with the batch when L > 0, lazily (one more only while the batch is short) when L = 0."""
    rounds = generation_rounds(args)
    return RolloutConfig(
        forced_lag=args.rl_forced_lag,
        groups_per_batch=args.grpo_prompts_per_step * rounds,
        group_size=args.grpo_group_size,
        seed=args.seed,
        sampling=sampling_params(args),
        rounds=rounds,
        lazy_rounds=rounds > 1 and args.rl_forced_lag == 0,
    )


def failure_budget(args: argparse.Namespace) -> FailureBudget:
    """The run-level limit on failed rollouts per environment, judged after a batch's worth."""
    return FailureBudget(
        max_fraction=args.rl_max_failed_rollout_fraction,
        min_rollouts=args.grpo_prompts_per_step * args.grpo_group_size,
    )


def inference_server_config(args: argparse.Namespace) -> InferenceServerConfig:
    """Where rank 0 serves remote environments, and the job's key (``--rl-api-key-file``, else
    ``MEGATRON_RL_API_KEY``). A key read from the file is also put into that variable, where
    remote agents (``RemoteAgentArgs.api_key_env``) find the key to send to env servers."""
    key = read_api_key(args.rl_api_key_file, os.environ, "--rl-api-key-file")
    if key is not None and args.rl_api_key_file is not None:
        os.environ[API_KEY_ENV] = key
    return InferenceServerConfig(args.rl_inference_server_host, args.rl_inference_server_port, key)


def scheduler_config(
    args: argparse.Namespace, dp_size: int, tokenizer: Tokenizer, training: bool = True
) -> SchedulerConfig:
    """Slots per data-parallel replica, sequence length and stop tokens of an engine; the
    training engine also takes ``--rl-deterministic-schedule`` and ``--rl-reward-wait-steps``."""
    config = SchedulerConfig(
        max_requests=args.inference_max_requests // dp_size,
        max_seq_len=args.seq_length,
        eos_id=tokenizer.eos_id,
        extra_stop_ids=tuple(tokenizer.extra_stop_ids),
    )
    if training:
        config = dataclasses.replace(
            config,
            window_target=args.rl_deterministic_schedule,
            reward_wait_steps=args.rl_reward_wait_steps,
        )
    return config


def eval_config(args: argparse.Namespace, tokenizer: Tokenizer | None = None) -> EvalConfig:
    """The evaluation described by the flags (sampled pass at the training sampling params, but
    always ending at EOS: ``--rl-ignore-eos`` is for training rollouts); the tokenizer's EOS and
    extra stop ids tell a finished response from a truncated one."""
    stops = () if tokenizer is None else (tokenizer.eos_id, *tokenizer.extra_stop_ids)
    return EvalConfig(
        num_prompts=args.eval_prompts,
        samples_per_prompt=args.eval_samples,
        pass_k=tuple(sorted(set(args.eval_pass_k))),
        sampling=sampling_params(args).model_copy(update={"ignore_eos": False}),
        correct_threshold=args.eval_correct_threshold,
        seed=args.seed,
        stop_token_ids=tuple(stops),
    )


def wandb_config(args: argparse.Namespace) -> WandbConfig | None:
    """wandb logging of ``--wandb-project`` (None when off); the directory defaults to
    ``<--save>/wandb``, else ``./wandb``."""
    if args.wandb_project is None:
        return None
    directory = args.wandb_save_dir or str(Path(args.save or ".") / "wandb")
    return WandbConfig(args.wandb_project, args.wandb_exp_name, directory, saved_args(args))


def tokenizer(args: argparse.Namespace) -> Tokenizer:
    """The tokenizer of ``--tokenizer-type``; one of ``--hf-checkpoint`` is checked against the
    checkpoint's embedding rows."""
    if args.tokenizer_type == "CharTokenizer":
        return CharTokenizer()
    try:
        if args.hf_config is not None:
            return load_hf_tokenizer(args.tokenizer_model, args.hf_config)
        return HuggingFaceTokenizer(args.tokenizer_model)
    except HFCheckpointError as err:
        raise SystemExit(f"pretrain_grpo.py: error: --tokenizer-model: {err}") from None
