"""Run config to library configs: the one place that maps the options to the RL library.

``megatron/trainer/flags`` declares every option once (with its one default) in its section and
validates them into a frozen ``RunConfig``; ``megatron.rl`` takes only the typed configs built
here from its sections. What the tiers read arrives as one ``TierConfig`` (``tier_config``:
the model build, the optimizer settings, ``--ref-load``), which ``model/provider.py``,
``train/optimizer.py`` and the tiers map to megatron-core's configs.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from megatron.rl.auth import API_KEY_ENV, api_key_source, read_api_key
from megatron.rl.eval.runner import EvalConfig
from megatron.rl.grpo.advantages.compute import AdvantageConfig
from megatron.rl.grpo.aggregation import LossAggregation
from megatron.rl.grpo.distill import DistillConfig
from megatron.rl.grpo.filtering import DynamicSamplingConfig
from megatron.rl.grpo.importance import ImportanceConfig
from megatron.rl.grpo.loss import GRPOLossConfig
from megatron.rl.grpo.off_policy_mask import OffPolicyMask
from megatron.rl.grpo.overlong import OverlongConfig
from megatron.rl.grpo.seq_logprob_error import SeqLogprobErrorConfig
from megatron.rl.grpo.terms import LossTerm, loss_terms
from megatron.rl.inference.scheduler import SchedulerConfig
from megatron.rl.lora.config import LoRAConfig
from megatron.rl.models.hf import HFCheckpointError, load_hf_tokenizer, read_hf_config
from megatron.rl.models.hf.tokenizer import HuggingFaceTokenizer
from megatron.rl.rollout.faults import FailureBudget
from megatron.rl.rollout.generator import RolloutConfig
from megatron.rl.server.limits import ServerLimits
from megatron.rl.tokenizer import CharTokenizer, Tokenizer
from megatron.rl.wire import SamplingParams
from megatron.trainer.checkpoint.directory import saved_args
from megatron.trainer.flags.distill import teacher_kind
from megatron.trainer.flags.run import RunConfig
from megatron.trainer.flags.streaming import forced_lag, streaming
from megatron.trainer.generation.rollouts import InferenceServerConfig, PipelineConfig
from megatron.trainer.metrics.record import WandbConfig
from megatron.trainer.model.provider import ModelBuild
from megatron.trainer.tiers.base import TeacherSource, TierConfig
from megatron.trainer.train.optimizer import OptimizerSettings
from megatron.trainer.train.step import StepConfig


def enabled_terms(cfg: RunConfig) -> tuple[LossTerm, ...]:
    """The loss terms whose weight flag is not 0 (``megatron/rl/grpo/terms``)."""
    terms = []
    for term in loss_terms():
        weight = cfg.grpo.weight(term.flag)
        if weight != 0.0:
            terms.append(term(weight))
    return tuple(terms)


def loss_config(cfg: RunConfig) -> GRPOLossConfig:
    """Clipping and the additive terms of the loss."""
    return GRPOLossConfig(
        clamp_eps_lower=cfg.grpo.clamp_eps_lower,
        clamp_eps_upper=cfg.grpo.clamp_eps_upper,
        terms=enabled_terms(cfg),
        **loss_variants(cfg),
    )


def step_config(cfg: RunConfig, vocab_size: int) -> StepConfig:
    """The train step: loss, micro-batching, clipping, iterations, IS correction, packing."""
    importance = None
    if cfg.grpo.is_correction:
        importance = ImportanceConfig(
            cfg.grpo.is_truncation_coef, cfg.grpo.is_mode, cfg.grpo.is_clip_min
        )
    return StepConfig(
        loss=loss_config(cfg),
        vocab_size=vocab_size,
        micro_batch_size=cfg.training.micro_batch_size,
        clip_grad=cfg.training.clip_grad,
        old_logprobs=cfg.grpo.iterations > 1,
        importance=importance,
        packing_capacity=cfg.model.seq_length if cfg.training.use_sequence_packing else None,
        check_finite=cfg.training.check_for_nan_in_loss_and_grad,
        distill=distill_config(cfg, vocab_size),
    )


def distill_config(cfg: RunConfig, vocab_size: int) -> DistillConfig | None:
    """The teacher term of ``--distill-teacher`` / ``--distill-coef`` /
    ``--distill-topk-logits-k`` (None: off); k is checked against the tokenizer's vocabulary."""
    distill = cfg.distillation
    if not distill.enabled:
        return None
    topk = distill.distill_topk_logits_k
    if topk is not None and topk > vocab_size:
        raise ValueError(
            f"--distill-topk-logits-k {topk} exceeds the vocabulary ({vocab_size} tokens)"
        )
    return DistillConfig(distill.coef, distill.reward, topk, argmax=not distill.remote)


def teacher_source(cfg: RunConfig) -> TeacherSource | None:
    """Where the distillation teacher's weights come from (None: no teacher, or coefficient 0)."""
    distill = cfg.distillation
    if not distill.enabled:
        return None
    directory = distill.distill_teacher
    if distill.remote:  # a server: its key is the job's (the inference server's) key
        flag = "--rl-api-key-file"
        return TeacherSource(
            directory, api_key=read_api_key(cfg.inference.api_key_file, os.environ, flag)
        )
    if teacher_kind(directory) != "hf":
        return TeacherSource(directory)
    divisible_by = cfg.model.make_vocab_size_divisible_by
    return TeacherSource(directory, read_hf_config(directory, divisible_by))


def seq_logprob_error_config(cfg: RunConfig) -> SeqLogprobErrorConfig | None:
    """The sequence-level logprob error of ``--rl-log-seq-logprob-error`` (metrics) and
    ``--rl-seq-logprob-error-threshold`` (masking; implies the metrics); None when off."""
    threshold = cfg.grpo.seq_logprob_error_threshold
    if threshold is None and not cfg.grpo.log_seq_logprob_error:
        return None
    return SeqLogprobErrorConfig(threshold)


def generation_rounds(cfg: RunConfig) -> int:
    """Rounds of groups generated per batch (> 1 only with dynamic sampling)."""
    return cfg.grpo.max_generation_rounds if cfg.grpo.filter_groups_with_same_reward else 1


def dynamic_sampling_config(cfg: RunConfig) -> DynamicSamplingConfig | None:
    """Dynamic sampling of ``--grpo-filter-groups-with-same-reward`` (None when off)."""
    if not cfg.grpo.filter_groups_with_same_reward:
        return None
    return DynamicSamplingConfig(cfg.grpo.prompts_per_step, generation_rounds(cfg))


def sampling_params(cfg: RunConfig) -> SamplingParams:
    """The default sampling of every generation request (Megatron-LM's "off" values: top-p 0,
    top-k -1, become ours: 1 and 0)."""
    return SamplingParams(
        temperature=cfg.rollouts.default_temperature,
        top_p=cfg.rollouts.default_top_p if cfg.rollouts.default_top_p > 0 else 1.0,
        top_k=max(cfg.rollouts.default_top_k, 0),
        max_tokens=cfg.rollouts.default_max_tokens,
        ignore_eos=cfg.rollouts.ignore_eos,
    )


def rollout_config(cfg: RunConfig) -> RolloutConfig:
    """What the forced-lag generator submits, and how far ahead: dynamic sampling's rounds all
    with the batch when L > 0, lazily (one more only while the batch is short) when L = 0."""
    rounds, mode, lag = generation_rounds(cfg), streaming(cfg), forced_lag(cfg)
    return RolloutConfig(
        forced_lag=lag,
        groups_per_batch=cfg.grpo.prompts_per_step * rounds,
        group_size=cfg.grpo.group_size,
        seed=cfg.training.seed,
        sampling=sampling_params(cfg),
        rounds=rounds,
        lazy_rounds=rounds > 1 and lag == 0,
        submission=mode.submission,
        consumption=mode.consumption,
        capacity=None if mode.is_batch else mode.capacity,
    )


def failure_budget(cfg: RunConfig) -> FailureBudget:
    """The run-level limit on failed rollouts per environment, judged after a batch's worth."""
    return FailureBudget(
        max_fraction=cfg.rollouts.max_failed_rollout_fraction,
        min_rollouts=cfg.grpo.prompts_per_step * cfg.grpo.group_size,
    )


def inference_server_config(cfg: RunConfig) -> InferenceServerConfig:
    """Where rank 0 serves remote environments, and the job's key (``--rl-api-key-file``, else
    ``MEGATRON_RL_API_KEY``). A key read from the file is also put into that variable, where
    remote agents (``RemoteAgentArgs.api_key_env``) find the key to send to env servers."""
    flag = "--rl-api-key-file"
    source = api_key_source(cfg.inference.api_key_file, os.environ, flag)
    key = read_api_key(cfg.inference.api_key_file, os.environ, flag)
    if key is not None and cfg.inference.api_key_file is not None:
        os.environ[API_KEY_ENV] = key
    return InferenceServerConfig(
        cfg.inference.inference_server_host,
        cfg.inference.inference_server_port,
        key,
        source,
        cfg.inference.tool_call_parser,
        server_limits(cfg),
    )


def server_limits(cfg: RunConfig, engine_slots: int | None = None) -> ServerLimits:
    """``--rl-max-request-body-mib``, ``--rl-max-request-tokens``, ``--rl-max-requests-per-client``
    and ``--rl-max-queued-requests`` (half of it for one client); ``engine_slots``: the slots
    the engine gives outside requests (``ContinuousBatchingScheduler.outside_capacity``)."""
    inference = cfg.inference
    return ServerLimits(
        max_body_bytes=int(inference.max_request_body_mib * (1 << 20)),
        max_request_tokens=inference.max_request_tokens,
        max_requests_per_client=inference.max_requests_per_client,
        max_queued_requests=inference.max_queued_requests,
        max_queued_per_client=max(1, inference.max_queued_requests // 2),
        engine_slots=engine_slots,
    )


def scheduler_config(
    cfg: RunConfig, dp_size: int, tokenizer: Tokenizer, training: bool = True
) -> SchedulerConfig:
    """Slots per data-parallel replica, sequence length and stop tokens of an engine; the
    training engine also takes ``--rl-deterministic-schedule`` and ``--rl-reward-wait-steps``."""
    config = SchedulerConfig(
        max_requests=cfg.inference.max_requests // dp_size,
        max_seq_len=cfg.model.seq_length,
        eos_id=tokenizer.eos_id,
        extra_stop_ids=tuple(tokenizer.extra_stop_ids),
    )
    if training:
        config = dataclasses.replace(
            config,
            window_target=cfg.inference.deterministic_schedule,
            reward_wait_steps=cfg.inference.reward_wait_steps,
            outside_slots=-(-cfg.inference.outside_request_slots // dp_size),  # ceil
            record_routing=cfg.model.routing_mode != "off",  # routing replay's record
        )
    return config


def eval_config(cfg: RunConfig, tokenizer: Tokenizer | None = None) -> EvalConfig:
    """The evaluation described by the flags (sampled pass at the training sampling params, but
    always ending at EOS: ``--rl-ignore-eos`` is for training rollouts); the tokenizer's EOS and
    extra stop ids tell a finished response from a truncated one."""
    stops = () if tokenizer is None else (tokenizer.eos_id, *tokenizer.extra_stop_ids)
    return EvalConfig(
        num_prompts=cfg.evaluation.prompts,
        samples_per_prompt=cfg.evaluation.samples,
        pass_k=tuple(sorted(set(cfg.evaluation.pass_k))),
        sampling=sampling_params(cfg).model_copy(update={"ignore_eos": False}),
        correct_threshold=cfg.evaluation.correct_threshold,
        seed=cfg.training.seed,
        stop_token_ids=tuple(stops),
    )


def wandb_config(cfg: RunConfig) -> WandbConfig | None:
    """wandb logging of ``--wandb-project`` (None when off); the directory defaults to
    ``<--save>/wandb``, else ``./wandb``."""
    if cfg.logging.wandb_project is None:
        return None
    directory = cfg.logging.wandb_save_dir or str(Path(cfg.checkpointing.save or ".") / "wandb")
    return WandbConfig(
        cfg.logging.wandb_project, cfg.logging.wandb_exp_name, directory, saved_args(cfg)
    )


def tokenizer(cfg: RunConfig) -> Tokenizer:
    """The tokenizer of ``--tokenizer-type``; one of ``--hf-checkpoint`` is checked against the
    checkpoint's embedding rows."""
    if cfg.model.tokenizer_type == "CharTokenizer":
        return CharTokenizer()
    try:
        if cfg.hf is not None:
            return load_hf_tokenizer(cfg.model.tokenizer_model, cfg.hf)
        return HuggingFaceTokenizer(cfg.model.tokenizer_model)
    except HFCheckpointError as err:
        raise SystemExit(f"pretrain_grpo.py: error: --tokenizer-model: {err}") from None


def loss_variants(cfg: RunConfig) -> dict[str, Any]:
    """The policy-loss variants of ``GRPOLossConfig``: ``--policy-loss``,
    ``--loss-agg-mode`` (Dr. GRPO's constant: ``--loss-scale-factor``, else
    ``--rl-default-max-tokens``, TRL's ``max_completion_length``) and
    ``--off-policy-mask-threshold``."""
    grpo = cfg.grpo
    scale = grpo.loss_scale_factor
    if scale is None and grpo.loss_agg_mode == "seq-mean-token-sum-norm":
        scale = float(cfg.rollouts.default_max_tokens)
    threshold = grpo.off_policy_mask_threshold
    return dict(
        policy_loss=grpo.policy_loss,
        aggregation=LossAggregation(grpo.loss_agg_mode, scale),
        off_policy_mask=None if threshold is None else OffPolicyMask(threshold),
    )


def advantage_config(cfg: RunConfig) -> AdvantageConfig:
    """The advantages' baseline and scale (``--adv-estimator``, ``--scale-rewards``)."""
    return AdvantageConfig(estimator=cfg.grpo.adv_estimator, scale=cfg.grpo.scale_rewards)


def overlong_config(cfg: RunConfig) -> OverlongConfig | None:
    """DAPO's soft overlong penalty and the mask of truncated completions (None when both are
    off); a rollout that records no budget is measured against ``--rl-default-max-tokens``."""
    if cfg.grpo.overlong_buffer_len == 0 and not cfg.grpo.mask_truncated_completions:
        return None
    return OverlongConfig(
        buffer_len=cfg.grpo.overlong_buffer_len,
        penalty_factor=cfg.grpo.overlong_penalty_factor,
        mask_truncated=cfg.grpo.mask_truncated_completions,
        default_max_tokens=cfg.rollouts.default_max_tokens,
    )


# ------------------------------------------------- the tiers and the rollout pipeline


def lora_config(cfg: RunConfig) -> LoRAConfig | None:
    """The adapters of the LoRA flags (None: full fine-tuning)."""
    lora = cfg.lora
    if not lora.enabled:
        return None
    return LoRAConfig(
        rank=lora.lora_rank,
        alpha=lora.lora_alpha,
        rslora=lora.lora_use_rslora,
        targets=tuple(lora.lora_target_modules),
        init=lora.lora_init,
        seed=cfg.training.seed,
    )


def model_build(cfg: RunConfig) -> ModelBuild:
    """What building the model reads: the model section, ``--hf-checkpoint``'s config, the
    parallel layout, ``--bf16``, ``--recompute-granularity`` and the LoRA adapters."""
    parallelism = cfg.parallelism
    return ModelBuild(
        section=cfg.model,
        hf=cfg.hf,
        tensor_parallel=parallelism.tensor_model_parallel_size,
        pipeline_parallel=parallelism.pipeline_model_parallel_size,
        expert_parallel=parallelism.expert_model_parallel_size,
        moe=cfg.architecture_flags.get("num_experts") is not None,
        bf16=cfg.training.bf16,
        recompute=cfg.training.recompute_granularity == "full",
        lora=lora_config(cfg),
        lora_checkpoint=cfg.lora.lora_checkpoint,
    )


def optimizer_settings(cfg: RunConfig) -> OptimizerSettings:
    """AdamW, gradient clipping and the LR schedule (``--lr-decay-iters`` defaults to
    ``--train-iters``)."""
    training = cfg.training
    return OptimizerSettings(
        lr=training.lr,
        min_lr=training.min_lr,
        weight_decay=training.weight_decay,
        adam_beta1=training.adam_beta1,
        adam_beta2=training.adam_beta2,
        adam_eps=training.adam_eps,
        clip_grad=training.clip_grad,
        warmup_iters=training.lr_warmup_iters,
        decay_iters=training.lr_decay_iters or training.train_iters,
        decay_style=training.lr_decay_style,
        train_iters=training.train_iters,
        distributed=cfg.parallelism.use_distributed_optimizer,
        check_finite=training.check_for_nan_in_loss_and_grad,
    )


def tier_config(cfg: RunConfig) -> TierConfig:
    """What a tier reads (``tiers.select_tier``): the model, the optimizer, ``--ref-load``,
    ``--distill-teacher``."""
    return TierConfig(
        model_build(cfg), optimizer_settings(cfg), cfg.grpo.ref_load, teacher_source(cfg)
    )


def pipeline_config(cfg: RunConfig, dp_size: int, tokenizer: Tokenizer) -> PipelineConfig:
    """The training rollout pipeline: generator, engine (its slots per replica of the training
    layout, ``dp_size`` replicas, or of the inference copy's), inference server, failure budget;
    a stop cancels the window in progress unless ``--save`` saves a checkpoint first."""
    inference_tp = cfg.parallelism.rl_inference_tensor_model_parallel_size
    if cfg.inference_ranks:  # the inference ranks' own run (inference_run_config): no copy
        inference_tp = None
    if inference_tp is not None:  # the engine's replicas are the inference copy's
        dp_size = cfg.world_size // inference_tp
    return PipelineConfig(
        rollout=rollout_config(cfg),
        engine=scheduler_config(cfg, dp_size, tokenizer),
        inference_tp=inference_tp,
        verify_refit=cfg.parallelism.rl_verify_model_weights_swap,
        server=inference_server_config(cfg),
        failure_budget=failure_budget(cfg),
        stop_cancels_window=not cfg.checkpointing.save,
    )
