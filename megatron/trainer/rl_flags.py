"""The RL flags of ``pretrain_grpo.py``: forced lag, sampling defaults, environments, the inference
server and its key, the engine's schedule, importance sampling, failed rollouts, sequence packing
and the data plane.

Each flag is declared once, with its help; the cross-field checks are in
``flag_validation.validate_args``.
"""

from __future__ import annotations

import argparse

from megatron.rl.grpo.importance import ImportanceConfig
from megatron.trainer.megatron_lm_flags import aliases_of


def optional_float(text: str) -> float | None:
    """A float, or ``none`` for no value."""
    return None if text.lower() == "none" else float(text)


def add_rl_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the RL flags: forced lag, sampling, environments, the inference server, the engine's
    schedule, importance sampling, failed rollouts, packing and the data plane."""
    g = parser.add_argument_group("RL")
    g.add_argument(
        "--rl-forced-lag",
        type=int,
        default=0,
        help="L: step N+L trains on rollouts submitted at step N (0 = on-policy).",
    )
    g.add_argument(
        "--rl-default-temperature",
        type=float,
        default=1.0,
        help="Sampling temperature (0 = greedy).",
    )
    g.add_argument(
        "--rl-default-top-p", type=float, default=0.0, help="Nucleus mass (0 or 1 = off)."
    )
    g.add_argument("--rl-default-top-k", type=int, default=-1, help="Top-k (-1 or 0 = off).")
    g.add_argument(
        "--rl-default-max-tokens",
        type=int,
        default=16,
        help="Generation budget when the environment sets none.",
    )
    g.add_argument(
        "--rl-ignore-eos",
        action="store_true",
        help="Generate every rollout to its full token budget: EOS and the tokenizer's other "
        "stop tokens do not end a generation (the same work per rollout, e.g. to compare "
        "throughput with another trainer).",
    )
    g.add_argument(
        "--env-config",
        *aliases_of("--env-config"),
        type=str,
        default=None,
        help="Env-config YAML (list of {agent_type, agent_args, weight}); default: the "
        "built-in digit-copy task.",
    )
    g.add_argument(
        "--rl-inference-server-host",
        type=str,
        default="127.0.0.1",
        help="Interface of the inference server that remote environments (agent_type: remote) "
        "generate through; 0.0.0.0 to reach it from other hosts.",
    )
    g.add_argument(
        "--rl-inference-server-port",
        type=int,
        default=0,
        help="Port of that inference server (0: a free port).",
    )
    g.add_argument(
        "--rl-api-key-file",
        type=str,
        default=None,
        help="File holding the job's shared key: the inference server requires it as a bearer "
        "token (401 without) and remote environments send it to env servers. Default: the "
        "environment variable MEGATRON_RL_API_KEY; neither: no key (keep servers on loopback).",
    )
    g.add_argument(
        "--inference-max-requests",
        type=int,
        default=64,
        help="Concurrent generation requests (KV-cache slots) of the whole job, split "
        "evenly over the data-parallel replicas; keeping it fixed keeps the generation "
        "schedule, and so the results, independent of the parallel layout.",
    )
    g.add_argument(
        "--rl-deterministic-schedule",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Step the requests of later batches only while the batch the trainer waits for "
        "still generates, so which policy version generates each token, and the whole run, is "
        "reproducible. --no-rl-deterministic-schedule keeps every batch in flight generating "
        "for the whole window, also while the awaited batch's rewards are computed or a new "
        "batch's requests are being sent: faster "
        "with slow rewards, but tokens then depend on timing (submission staleness stays "
        "exact).",
    )
    g.add_argument(
        "--rl-reward-wait-steps",
        type=int,
        default=0,
        help="With --rl-deterministic-schedule: once the batch the trainer waits for has "
        "finished generating, the engine steps the later batches in flight for this many more "
        "engine steps (fewer if they have nothing left to generate), and the trainer takes the "
        "batch only after them, whatever the rewards' timing. Fills the wait for slow rewards "
        "with generation and keeps the run reproducible; tokens of later batches then come from "
        "earlier policy versions. 0: later batches step only while the awaited batch generates.",
    )
    g.add_argument(
        "--rl-inference-logprobs-is-correction",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Take the ratio against the trainer's pre-update policy and weight each token by "
        "the truncated importance weight min(pi_old / pi_inference, C) with the engine's "
        "per-token logprobs; logs the train/inference mismatch (is_* metrics).",
    )
    g.add_argument(
        "--rl-importance-sampling-truncation-coef",
        type=optional_float,
        default=ImportanceConfig.truncation_coef,
        help="C of --rl-inference-logprobs-is-correction: importance weights above C are set to "
        "C; 'none' caps nothing (Megatron-LM's default). Our default 1 only ever down-weights a "
        "token (see megatron/rl/grpo/importance.py).",
    )
    g.add_argument(
        "--rl-seq-logprob-error-threshold",
        type=optional_float,
        default=None,
        help="Mask out of the loss every sequence whose logprob error exceeds this (NeMo-RL's "
        "grpo.seq_logprob_error_threshold, e.g. 1.5): the mean over its generated tokens of "
        "exp(|log pi_old - log pi_inference|), with pi_old the policy before the collection's "
        "first update (one more forward pass when the step has no pi_old). The token-mean loss "
        "is normalised over the remaining tokens. Logs the error's min/mean/max before and "
        "after the mask, the masked sequences and the share of them that were rewarded "
        "(seq_mult_prob_error_*, seq_logprob_error_*). Default: no mask.",
    )
    g.add_argument(
        "--rl-log-seq-logprob-error",
        action="store_true",
        help="Log the sequence-level logprob error (seq_mult_prob_error_min/mean/max, see "
        "--rl-seq-logprob-error-threshold) without masking anything.",
    )
    g.add_argument(
        "--rl-max-failed-rollout-fraction",
        type=float,
        default=0.5,
        help="Stop the run, naming the environment and its first error, once more than this "
        "share of an environment's rollouts failed (environment errors become masked "
        "placeholder rollouts, in process and behind the env server alike; each distinct error "
        "is logged once). Judged once the environment produced --grpo-prompts-per-step x "
        "--grpo-group-size rollouts; 1 never stops (a batch whose every rollout failed always "
        "does).",
    )
    g.add_argument(
        "--rl-use-sequence-packing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Pack the rollouts of each micro-batch into rows of --seq-length tokens with "
        "per-sequence attention (block-diagonal causal mask, positions restarting at 0).",
    )
    g.add_argument(
        "--rl-data-plane",
        choices=("in-process", "transferqueue"),
        default="in-process",
        help="Where each collection's rollouts live: rank 0 writes each sample once under its "
        "own key and every data-parallel rank fetches only the keys of its shard (logprobs and "
        "reference logprobs are written back as fields; the partition is cleared when the "
        "collection ends). 'in-process': rank 0 holds the store and serves it point to point; "
        "'transferqueue': the TransferQueue package on Ray (pip install '.[transferqueue]'; "
        "rank 0 starts a local Ray, the other ranks attach to it).",
    )
