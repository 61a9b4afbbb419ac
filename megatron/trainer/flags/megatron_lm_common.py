"""Megatron-LM's general (non-RL) flags that its RL example command lines use, and what each is here.

Megatron-LM's ``examples/rl`` commands (its README's Qwen 2.5 32B experiment, ``model_configs/
*.sh`` with ``common.sh``) pass some 90 flags; the RL ones are ``megatron/trainer/flags/megatron_lm.py``'s table,
model and training flags we share are declared by us with the same meaning. The rest are listed
here, once each:

* ``accepted``: the flag means here what it means there, because what it selects is what this
  trainer always does (``--use-mcore-models``, dropout 0, a per-token loss); ``values`` restricts
  it to the values for which that holds, ``same_as`` to a value equal to one of our flags';
* ``alias``: Megatron-LM's spelling of one of our flags (``rewrite``: the tokens it becomes);
* ``refused``: not available here; the reason, and what to use instead where there is something.

``command_line.prepare`` applies the table before argparse parses, and every problem of a
command line is reported in one message (``docs/user_guide.md`` renders the table:
``render_table``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["accepted", "alias", "refused"]


@dataclass(frozen=True)
class CommonFlag:
    """One Megatron-LM general flag and how ``pretrain_grpo.py`` treats it."""

    flag: str
    status: Status
    reason: str
    """Why, in one sentence (the user guide's table; the error of a refused flag or value)."""
    takes_value: bool = True
    values: tuple[str, ...] | None = None
    """``accepted``/``alias`` only with one of these values (any other is refused)."""
    same_as: str | None = None
    """``accepted`` only when the value equals this flag's (its default when not given)."""
    rewrite: tuple[str, ...] = ()
    """``alias``: the tokens it becomes (its value appended when it takes one); ``refused``: the
    flag to use instead, if any (one token)."""


NO_CUDA_GRAPHS = "megatron-core's engine runs without CUDA graphs here"
KV_MEMORY = "the engine's KV memory follows --inference-max-requests and --seq-length"
TIMINGS = "step_seconds, collect_seconds and train_seconds are in every metrics record"
NO_STRAGGLER = (
    "no straggler detector; --watchdog-timeout-minutes stops a run that stops progressing"
)

MEGATRON_LM_COMMON_FLAGS: tuple[CommonFlag, ...] = (
    CommonFlag("--use-mcore-models", "accepted", "models are always megatron-core's", False),
    CommonFlag(
        "--transformer-impl",
        "accepted",
        "Transformer Engine layers on CUDA where it is importable (local layers on the "
        "CPU tier); 'local' cannot be forced on CUDA",
        values=("transformer_engine",),
    ),
    CommonFlag(
        "--te-rng-tracker",
        "accepted",
        "Transformer Engine's RNG tracker serves dropout, which this model does not have",
        False,
    ),
    CommonFlag(
        "--attention-dropout",
        "accepted",
        "the model has no dropout (post-training here runs without it)",
        values=("0", "0.0"),
    ),
    CommonFlag(
        "--hidden-dropout",
        "accepted",
        "the model has no dropout (post-training here runs without it)",
        values=("0", "0.0"),
    ),
    CommonFlag(
        "--calculate-per-token-loss",
        "accepted",
        "the loss is the token sum over the global batch divided by its token count",
        False,
    ),
    CommonFlag(
        "--accumulate-allreduce-grads-in-fp32",
        "accepted",
        "gradients are float32 (float32 master weights; --bf16 is autocast)",
        False,
    ),
    CommonFlag(
        "--attention-softmax-in-fp32", "accepted", "attention softmax is computed in float32", False
    ),
    CommonFlag(
        "--no-masked-softmax-fusion", "accepted", "no fused masked softmax is used here", False
    ),
    CommonFlag(
        "--no-create-attention-mask-in-dataloader",
        "accepted",
        "there is no dataloader; the trainer builds attention masks",
        False,
    ),
    CommonFlag(
        "--mock-data",
        "accepted",
        "there is no pretraining data: prompts come from --env-config environments",
        False,
    ),
    CommonFlag(
        "--data-cache-path",
        "accepted",
        "there is no pretraining data to cache (the path is not used)",
    ),
    CommonFlag(
        "--log-throughput", "accepted", "tokens per second are in every metrics record", False
    ),
    CommonFlag(
        "--log-timers-to-tensorboard",
        "accepted",
        "step timings go to --tensorboard-dir with every other metric",
        False,
    ),
    CommonFlag(
        "--tensorboard-log-interval",
        "accepted",
        "every step is written to --tensorboard-dir",
        values=("1",),
    ),
    CommonFlag(
        "--inference-max-seq-length",
        "accepted",
        "the engine's sequence length is --seq-length",
        same_as="--seq-length",
    ),
    CommonFlag(
        "--rl-sequence-packing-bin-size",
        "accepted",
        "packed rows are --seq-length tokens",
        same_as="--seq-length",
    ),
    CommonFlag(
        "--inference-max-batch-size",
        "alias",
        "requests decoded at once per data-parallel replica",
        rewrite=("--inference-max-requests",),
    ),
    CommonFlag(
        "--use-rotary-position-embeddings",
        "alias",
        "rotary position embeddings",
        False,
        rewrite=("--position-embedding-type", "rope"),
    ),
    CommonFlag(
        "--lr-warmup-samples",
        "alias",
        "warmup is counted in iterations (one iteration = one global batch)",
        values=("0",),
        rewrite=("--lr-warmup-iters",),
    ),
    CommonFlag(
        "--pretrained-checkpoint",
        "refused",
        "start from a Hugging Face directory (--hf-checkpoint) or from one of our "
        "checkpoints (--load DIR --finetune)",
        rewrite=("--hf-checkpoint",),
    ),
    CommonFlag(
        "--train-samples",
        "refused",
        "the run length is counted in iterations (one iteration = one global batch)",
        rewrite=("--train-iters",),
    ),
    CommonFlag(
        "--recompute-activations",
        "refused",
        "selective recompute is not available; full recompute is",
        False,
        rewrite=("--recompute-granularity",),
    ),
    CommonFlag("--sequence-parallel", "refused", "sequence parallelism is not implemented", False),
    CommonFlag(
        "--attention-backend",
        "refused",
        "the attention kernel follows the tier (Transformer Engine on CUDA, SDPA on CPU)",
    ),
    CommonFlag(
        "--data-parallel-random-init",
        "refused",
        "every data-parallel rank starts from the same weights",
        False,
    ),
    CommonFlag(
        "--initialize-socket-comms",
        "refused",
        "no socket communicator: rank 0 reaches environments over HTTP",
        False,
    ),
    CommonFlag(
        "--empty-unused-memory-level",
        "refused",
        "the CUDA caching allocator is not emptied between phases",
    ),
    CommonFlag(
        "--save-retain-interval",
        "refused",
        "every checkpoint is kept; remove old iter_* directories yourself",
    ),
    CommonFlag("--cuda-graph-impl", "refused", NO_CUDA_GRAPHS),
    CommonFlag("--inference-num-cuda-graphs", "refused", NO_CUDA_GRAPHS),
    CommonFlag("--inference-dynamic-batching-num-cuda-graphs", "refused", NO_CUDA_GRAPHS),
    CommonFlag(
        "--inference-buffer-size-gb", "refused", KV_MEMORY, rewrite=("--inference-max-requests",)
    ),
    CommonFlag(
        "--inference-dynamic-batching-buffer-size-gb",
        "refused",
        KV_MEMORY,
        rewrite=("--inference-max-requests",),
    ),
    CommonFlag(
        "--inference-dynamic-batching-unified-memory-level",
        "refused",
        "no unified memory for the engine",
    ),
    CommonFlag("--timing-log-level", "refused", TIMINGS, rewrite=("--metrics-file",)),
    CommonFlag("--timing-log-option", "refused", TIMINGS, rewrite=("--metrics-file",)),
    CommonFlag(
        "--log-progress",
        "refused",
        "no progress.txt; the metrics file has every step",
        False,
        rewrite=("--metrics-file",),
    ),
    CommonFlag("--log-params-norm", "refused", "the parameter norm is not computed", False),
    CommonFlag("--log-num-zeros-in-grad", "refused", "zeros in gradients are not counted", False),
    CommonFlag("--log-straggler", "refused", NO_STRAGGLER, False),
    CommonFlag("--disable-straggler-on-startup", "refused", NO_STRAGGLER, False),
    CommonFlag("--straggler-minmax-count", "refused", NO_STRAGGLER),
)
"""Every general Megatron-LM flag of its RL examples that is not one of ours."""

BY_FLAG = {entry.flag: entry for entry in MEGATRON_LM_COMMON_FLAGS}


def render_table() -> str:
    """The user guide's markdown table of ``MEGATRON_LM_COMMON_FLAGS``."""
    rows = ["| Megatron-LM flag | here | why |", "| --- | --- | --- |"]
    for e in MEGATRON_LM_COMMON_FLAGS:
        status = e.status
        if e.values:
            status += " (" + " or ".join(f"`{v}`" for v in e.values) + " only)"
        if e.same_as:
            status += f" (equal to `{e.same_as}`)"
        if e.rewrite:
            status += f": `{' '.join(e.rewrite)}`" if e.status == "alias" else ""
        instead = f"; use `{e.rewrite[0]}`" if e.status == "refused" and e.rewrite else ""
        rows.append(f"| `{e.flag}` | {status} | {e.reason}{instead} |")
    return "\n".join(rows)
