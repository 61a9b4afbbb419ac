"""Megatron-LM's RL flags and what each one is here: the same flag, another spelling, or refused.

Every flag of Megatron-LM's RL argument group (``_add_rl_args``; read at Megatron-LM commit
d98e8a64) is listed once in ``MEGATRON_LM_RL_FLAGS``:

* ``same``: we declare the flag with Megatron-LM's meaning and "off" value (our default may differ;
  its ``--help`` then says so);
* ``alias``: Megatron-LM's spelling of one of our flags with the same meaning; the parser accepts
  it as another option string of ours;
* ``refused``: the meaning differs from ours (or the feature does not exist here); the parser
  accepts the spelling only to exit with a message that points to our equivalent.

``docs/user_guide.md`` renders this table (``render_table``); a test checks that the two agree, that
each refused row's reason is the parser's message, and that the parser does what each row says.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

Status = Literal["same", "alias", "refused"]


@dataclass(frozen=True)
class MegatronFlag:
    """One Megatron-LM RL flag and how ``pretrain_grpo.py`` treats it."""

    flag: str
    """Megatron-LM's option string."""
    status: Status
    ours: str | None
    """Our flag (``same``: the flag itself; ``alias``: the flag it spells; ``refused``: what to use
    instead, if anything)."""
    reason: str
    """Why, in one sentence (shown in the user guide and, for refused flags, in the error)."""
    takes_value: bool = True
    """Whether the flag is followed by a value (refused flags must still parse)."""


MEGATRON_LM_RL_FLAGS: tuple[MegatronFlag, ...] = (
    MegatronFlag(
        "--perform-rl-step",
        "refused",
        None,
        "this program only does RL steps; drop the flag",
        False,
    ),
    MegatronFlag(
        "--rl-prompts-per-eval",
        "alias",
        "--eval-prompts",
        "held-out prompts evaluated per environment",
    ),
    MegatronFlag(
        "--grpo-prompts-per-step", "same", "--grpo-prompts-per-step", "groups per collection"
    ),
    MegatronFlag("--grpo-group-size", "same", "--grpo-group-size", "rollouts per group"),
    MegatronFlag(
        "--grpo-iterations",
        "same",
        "--grpo-iterations",
        "passes over each collection, each pass a training iteration per global batch "
        "(LR schedule and policy version advance every iteration)",
    ),
    MegatronFlag(
        "--grpo-clamp-eps-lower", "same", "--grpo-clamp-eps-lower", "lower clip of the ratio"
    ),
    MegatronFlag(
        "--grpo-clamp-eps-upper", "same", "--grpo-clamp-eps-upper", "upper clip of the ratio"
    ),
    MegatronFlag(
        "--grpo-kl-beta",
        "same",
        "--grpo-kl-beta",
        "k3 KL weight; 0 also skips the reference model (Megatron-LM still computes "
        "its logprobs)",
    ),
    MegatronFlag(
        "--grpo-entropy-term-weight", "same", "--grpo-entropy-term-weight", "entropy bonus weight"
    ),
    MegatronFlag(
        "--grpo-filter-groups-with-same-reward",
        "same",
        "--grpo-filter-groups-with-same-reward",
        "drop groups whose rewards are all equal; regenerated in bounded rounds "
        "(--grpo-max-generation-rounds) instead of unbounded, and a short batch trains "
        "on the groups that remain",
        False,
    ),
    MegatronFlag(
        "--langrl-env-config",
        "alias",
        "--env-config",
        "the env-config YAML (agent_type, agent_args, weight, evaluation_only)",
    ),
    MegatronFlag(
        "--rl-default-temperature",
        "same",
        "--rl-default-temperature",
        "sampling temperature; 0 is greedy here (Megatron-LM sends 0 as 1.0)",
    ),
    MegatronFlag("--rl-default-top-p", "same", "--rl-default-top-p", "nucleus mass, 0 = off"),
    MegatronFlag(
        "--rl-default-top-k",
        "same",
        "--rl-default-top-k",
        "top-k, -1 or 0 = off (Megatron-LM no longer forwards it to its engine)",
    ),
    MegatronFlag(
        "--rl-offload-optimizer-during-inference",
        "refused",
        None,
        "the engine shares the trained model's memory; offloading is not implemented",
        False,
    ),
    MegatronFlag(
        "--rl-kv-cache-management-mode",
        "refused",
        None,
        "the CPU tier keeps its KV cache, the CUDA tier frees it during training",
    ),
    MegatronFlag(
        "--rl-persist-cuda-graphs", "refused", None, "CUDA graphs are not used by the engine", False
    ),
    MegatronFlag(
        "--no-rl-persist-cuda-graphs",
        "refused",
        None,
        "CUDA graphs are not used by the engine",
        False,
    ),
    MegatronFlag(
        "--rl-partial-rollouts",
        "same",
        "--rl-partial-rollouts",
        "generation spans weight updates in units finer than a batch (needed by G submission)",
        False,
    ),
    MegatronFlag(
        "--no-rl-partial-rollouts",
        "same",
        "--no-rl-partial-rollouts",
        "whole batches only (the default)",
        False,
    ),
    MegatronFlag(
        "--rl-generation-lag",
        "same",
        "--rl-generation-lag",
        "the gate holds max(1, round((L+1) x units per batch)) units; B/B at an integer L is "
        "--rl-forced-lag L; autotuned with --rl-partial-rollouts when unset",
    ),
    MegatronFlag(
        "--rl-max-inflight-requests",
        "same",
        "--rl-max-inflight-requests",
        "the lag M / (P x G) - 1",
    ),
    MegatronFlag(
        "--rl-submission-granularity",
        "same",
        "--rl-submission-granularity",
        "B or G (R: not implemented yet); the units and release points of Megatron-LM, at fixed "
        "points of the deterministic schedule",
    ),
    MegatronFlag(
        "--rl-consumption-granularity",
        "same",
        "--rl-consumption-granularity",
        "B or G, in submission order (Megatron-LM's G follows completion order, which depends "
        "on timing)",
    ),
    MegatronFlag(
        "--rl-durable-rollout-bank",
        "refused",
        "--save",
        "checkpoints save the pipeline as it stands (unconsumed groups, generation in flight)",
        False,
    ),
    MegatronFlag(
        "--rl-rollout-bank-dir", "refused", "--save", "checkpoints save the rollout state"
    ),
    MegatronFlag(
        "--rl-rollout-bank-max-bytes", "refused", "--save", "checkpoints save the rollout state"
    ),
    MegatronFlag(
        "--rl-inference-logprobs-is-correction",
        "same",
        "--rl-inference-logprobs-is-correction",
        "weight tokens by min(pi_old / pi_inference, C)",
        False,
    ),
    MegatronFlag(
        "--no-rl-inference-logprobs-is-correction",
        "same",
        "--no-rl-inference-logprobs-is-correction",
        "turn the IS correction off",
        False,
    ),
    MegatronFlag(
        "--rl-importance-sampling-truncation-coef",
        "same",
        "--rl-importance-sampling-truncation-coef",
        "C of the IS correction; our default is 1.0 (Megatron-LM: none), 'none' = no cap",
    ),
    MegatronFlag(
        "--rl-use-sequence-packing",
        "same",
        "--rl-use-sequence-packing",
        "pack rollouts into rows of --seq-length (any --micro-batch-size here)",
        False,
    ),
    MegatronFlag(
        "--no-rl-use-sequence-packing", "same", "--no-rl-use-sequence-packing", "no packing", False
    ),
    MegatronFlag(
        "--rl-sequence-packing-max-sequences-per-bin",
        "refused",
        None,
        "packing is first-fit decreasing into --seq-length rows, unbounded count",
    ),
    MegatronFlag(
        "--rl-sequence-packing-algo",
        "refused",
        None,
        "packing runs per micro-batch on each data-parallel rank",
    ),
    MegatronFlag("--rl-training-cuda-graphs", "refused", None, "CUDA graphs are not used", False),
    MegatronFlag(
        "--no-rl-training-cuda-graphs", "refused", None, "CUDA graphs are not used", False
    ),
    MegatronFlag(
        "--rl-inference-tensor-model-parallel-size",
        "same",
        "--rl-inference-tensor-model-parallel-size",
        "generation on a copy of the model at this TP degree, refit after every optimizer step "
        "(a whole stage; an MoE copy holds every expert)",
    ),
    MegatronFlag(
        "--rl-inference-pipeline-model-parallel-size",
        "same",
        "--rl-inference-pipeline-model-parallel-size",
        "an inference copy is one whole stage (1 is the size implemented), refit from every "
        "training stage",
    ),
    MegatronFlag(
        "--rl-inference-expert-model-parallel-size",
        "same",
        "--rl-inference-expert-model-parallel-size",
        "the inference copy of an MoE model holds every expert: 1 is the size implemented",
    ),
    MegatronFlag(
        "--rl-inference-expert-tensor-model-parallel-size",
        "same",
        "--rl-inference-expert-tensor-model-parallel-size",
        "the copy's experts are split over its TP ranks: the inference TP size is the one "
        "implemented",
    ),
    MegatronFlag(
        "--rl-inference-model-unified-memory-level", "refused", None, "no separate inference model"
    ),
    MegatronFlag(
        "--rl-offload-inference-model-weights-when-idle",
        "refused",
        None,
        "no separate inference model",
        False,
    ),
    MegatronFlag(
        "--refit-mode",
        "same",
        "--refit-mode",
        "collocated (on the training ranks) or non-collocated (the job's last inference-TP ranks "
        "only generate, a collection behind the trainer; dense models)",
    ),
    MegatronFlag(
        "--refit-method",
        "same",
        "--refit-method",
        "how a refit moves weights: gloo on CPU, nccl on CUDA (nvshmem is not offered)",
    ),
    MegatronFlag(
        "--rl-verify-model-weights-swap",
        "same",
        "--rl-verify-model-weights-swap",
        "after every refit, the inference copy checked against the trained weights (on the "
        "receiving side, non-collocated)",
        False,
    ),
    MegatronFlag(
        "--rl-skip-bos-token",
        "refused",
        None,
        "prompts are tokenized by the tokenizer's own rules",
        False,
    ),
    MegatronFlag(
        "--rl-profile",
        "refused",
        "--metrics-file",
        "per-step timings are in every metrics record",
        False,
    ),
    MegatronFlag(
        "--rl-profile-dir",
        "refused",
        "--metrics-file",
        "per-step timings are in every metrics record",
    ),
    MegatronFlag("--rl-inference-parsers", "refused", None, "responses are returned as generated"),
)
"""Every flag of Megatron-LM's RL argument group, in its order."""


class RefusedFlag(argparse.Action):
    """Parses a Megatron-LM flag we do not take, then exits naming our equivalent."""

    def __init__(self, option_strings, dest, entry: MegatronFlag, **kwargs):
        kwargs["nargs"] = "?" if entry.takes_value else 0
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, **kwargs)
        self.entry = entry

    def __call__(self, parser, namespace, values, option_string=None):
        instead = f"; use {self.entry.ours}" if self.entry.ours else ""
        parser.error(
            f"{self.entry.flag} (Megatron-LM) is not supported: {self.entry.reason}{instead}"
        )


def add_refused_flags(parser: argparse.ArgumentParser) -> None:
    """Declare every refused Megatron-LM flag (hidden from ``--help``)."""
    for entry in MEGATRON_LM_RL_FLAGS:
        if entry.status == "refused":
            parser.add_argument(entry.flag, action=RefusedFlag, entry=entry, help=argparse.SUPPRESS)


def aliases_of(flag: str) -> tuple[str, ...]:
    """Megatron-LM spellings of our ``flag``."""
    return tuple(e.flag for e in MEGATRON_LM_RL_FLAGS if e.status == "alias" and e.ours == flag)


def render_table() -> str:
    """The user guide's markdown table of ``MEGATRON_LM_RL_FLAGS``."""
    rows = ["| Megatron-LM flag | here | ours | why |", "| --- | --- | --- | --- |"]
    for e in MEGATRON_LM_RL_FLAGS:
        ours = f"`{e.ours}`" if e.ours else ""
        rows.append(f"| `{e.flag}` | {e.status} | {ours} | {e.reason} |")
    return "\n".join(rows)
